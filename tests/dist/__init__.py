"""torchrun scripts that tests launch with testkit.run_torchrun."""
