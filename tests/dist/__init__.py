"""torchrun scripts that tests launch with rollpacker.testing.run_torchrun."""
