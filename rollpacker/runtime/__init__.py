"""The SPMD program's runtime: process groups, the phases of a step, and their state."""
