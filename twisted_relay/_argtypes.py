"""
Argument types shared by the console scripts (``argparse`` ``type=`` values):
a bad value is a usage error that names what is wrong, never a traceback.
"""

from __future__ import annotations

import argparse
from typing import Callable

__all__ = ["seconds", "whole_number"]


def whole_number(minimum: int = 0) -> Callable[[str], int]:
    """A whole number of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be {minimum} or more")
        return value

    return parse


def seconds(*, allow_zero: bool, maximum: float | None = None) -> Callable[[str], float]:
    """A number of seconds: more than 0 (or at least 0), and below ``maximum``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds")
        if value < 0 or (value == 0 and not allow_zero):
            limit = "0 or more" if allow_zero else "more than 0"
            raise argparse.ArgumentTypeError(f"{text!r} must be {limit}")
        if maximum is not None and value >= maximum:
            raise argparse.ArgumentTypeError(f"{text!r} must be below {maximum:g} seconds")
        return value

    return parse
