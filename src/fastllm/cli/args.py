"""argparse types shared by the commands."""
import argparse


def whole_number(minimum: int, maximum: int | None = None):
    """An argparse type: a whole number >= minimum (and <= maximum). A bad
    value is refused naming the flag, before anything is loaded."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value
    return parse
