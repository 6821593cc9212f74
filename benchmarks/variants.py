"""Engine variants named by suffixes (`conditional-sync-paths`): how a benchmark runs one
method under other engine arguments or plugin switches, with the name saying which."""

from __future__ import annotations


def split_suffixes(name: str, suffixes: dict[str, tuple[dict, dict]]) -> tuple[str, dict, dict]:
    """name -> (its base, the engine arguments and the environment of its suffixes), in
    any order: suffixes maps '-suffix' to (engine arguments, environment variables)."""
    engine, env = {}, {}
    stripped = True
    while stripped:
        stripped = False
        for suffix, (arguments, variables) in suffixes.items():
            if name.endswith(suffix):
                name = name.removesuffix(suffix)
                engine, env = engine | arguments, env | variables
                stripped = True
    return name, engine, env
