"""Engine variants named by suffixes (`conditional-sync-paths`): how a benchmark runs one
method under other engine arguments or plugin switches, with the name saying which."""

from __future__ import annotations


def split_suffixes(name: str, suffixes: dict[str, tuple[dict, dict]]) -> tuple[str, dict, dict]:
    """name -> (its base, the engine arguments and the environment of its suffixes), in
    any order: suffixes maps '-suffix' to (engine arguments, environment variables). The
    longest suffix that ends the name is taken first, so that `-one-pass-fixup` is not
    read as `-one-pass` and `-fixup`."""
    engine, env = {}, {}
    by_length = sorted(suffixes, key=len, reverse=True)
    while True:
        suffix = next((s for s in by_length if name.endswith(s)), None)
        if suffix is None:
            return name, engine, env
        arguments, variables = suffixes[suffix]
        name = name.removesuffix(suffix)
        engine, env = engine | arguments, env | variables
