"""Peer projects' functions transcribed with file:line citations, to compare ours with on shared inputs."""
