"""The few exceptions tandem raises for bad input; everything else is a bug."""


class TandemError(Exception):
    """Base of tandem's user-facing errors: the message names field, value and rule."""


class ConfigError(TandemError):
    """A model or server configuration breaks a rule (found before any tensor data is read)."""


class WeightsError(TandemError):
    """A weight file lacks a tensor, or holds one of the wrong shape."""


def check_rules(rules: list[tuple[bool, str, object, str]]) -> None:
    """Raise a ConfigError for the first broken rule, each given as (holds, field, value, rule)."""
    for holds, name, value, rule in rules:
        if not holds:
            raise ConfigError(f"{name}={value!r}: {rule}")
