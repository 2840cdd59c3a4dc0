"""Find and load spec files: the shipped ones by name, a user's own by path.

A bare name (``megatron-llama``) is always a shipped spec, found among the package resources of
``reshard.specs``: a ``specs/`` folder in the current directory never shadows them. A user's own spec
is used only when named by path (it contains a ``/`` or ends in ``.spec``).

``include NAME`` lines are expanded here (the parser itself never opens files): NAME is looked up
next to the including file, then among the shipped specs, with ``.spec`` appended when it has no suffix.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from reshard.core.spec import Include, Spec, parse_spec
from reshard.errors import SpecError

__all__ = ["available_specs", "load_spec", "shipped_dir"]


def shipped_dir() -> Path:
    """The folder of the shipped specs (the ``reshard.specs`` package)."""
    return Path(str(resources.files("reshard.specs")))


def available_specs() -> list[str]:
    """Names of the shipped specs (``megatron-llama``, ...)."""
    return sorted(p.stem for p in shipped_dir().glob("*.spec"))


def load_spec(name_or_path: str | Path, _seen: tuple[Path, ...] = ()) -> Spec:
    """Parse a spec by shipped name or by path, with its includes expanded in place.

    Raises:
      SpecError: the file is missing, includes itself, or does not parse.
    """
    text = str(name_or_path)
    by_path = isinstance(name_or_path, Path) or "/" in text or text.endswith(".spec")
    path = _as_file(Path(text)) if by_path else _shipped(text)
    if path is None:
        where = f"no spec file {text}" if by_path else f"no shipped spec '{text}'"
        raise SpecError(f"{where} (shipped specs: {', '.join(available_specs()) or 'none'}; "
                        "a spec of your own is named by its path)")
    if path in _seen:
        chain = " -> ".join(p.name for p in (*_seen, path))
        raise SpecError(f"include cycle: {chain}", source=str(path))
    spec = parse_spec(path.read_text(encoding="utf-8"), source=_display(path))
    statements = []
    included = list(spec.included)
    for st in spec.statements:
        if not isinstance(st, Include):
            statements.append(st)
            continue
        target = _as_file(path.parent / st.path) or _shipped(st.path)
        if target is None:
            raise spec.error(f"cannot find included spec '{st.path}' (looked next to {path.name} and among the "
                             "shipped specs)", st.pos)
        inner = load_spec(target, (*_seen, path))
        statements += inner.statements
        included += [(inner.source, inner.lines), *inner.included]
    return Spec(source=spec.source, statements=tuple(statements), lines=spec.lines, included=tuple(included))


def _as_file(path: Path) -> Path | None:
    for p in (path, path.with_name(path.name + ".spec")) if path.suffix != ".spec" else (path,):
        if p.is_file():
            return p.resolve()
    return None


def _shipped(name: str) -> Path | None:
    if "/" in name or name.startswith("."):
        return None
    return _as_file(shipped_dir() / name)


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
