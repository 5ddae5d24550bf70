"""One help format for every command line tool: the description as written, each option's default."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" where there is a default to show (not for unset options or flags)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, [], argparse.SUPPRESS) or not action.help:
            return action.help
        return super()._get_help_string(action)
