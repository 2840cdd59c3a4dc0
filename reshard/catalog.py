"""Find and load spec files: the ones shipped in ``specs/`` by name, or any path.

``include NAME`` lines are expanded here (the parser itself never opens
files): NAME is looked up next to the including file, then among the shipped
specs, with ``.spec`` appended when it has no suffix.
"""

from __future__ import annotations

from pathlib import Path

from reshard.errors import SpecError
from reshard.spec import Include, Spec, parse_spec

__all__ = ["SPECS_DIR", "available_specs", "load_spec"]

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"


def available_specs() -> list[str]:
    """Names of the shipped specs (``megatron-llama``, ...)."""
    return sorted(p.stem for p in SPECS_DIR.glob("*.spec"))


def load_spec(name_or_path: str | Path, _seen: tuple[Path, ...] = ()) -> Spec:
    """Parse a spec by shipped name or path, with its includes expanded in place.

    Raises:
      SpecError: the file is missing, includes itself, or does not parse.
    """
    path = _find(str(name_or_path), Path.cwd())
    if path is None:
        raise SpecError(f"no spec '{name_or_path}' (shipped specs: {', '.join(available_specs()) or 'none'})")
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
        target = _find(st.path, path.parent)
        if target is None:
            raise spec.error(f"cannot find included spec '{st.path}' (looked next to {path.name} and in {_display(SPECS_DIR)})", st.pos)
        inner = load_spec(target, (*_seen, path))
        statements += inner.statements
        included += [(inner.source, inner.lines), *inner.included]
    return Spec(source=spec.source, statements=tuple(statements), lines=spec.lines, included=tuple(included))


def _find(name: str, here: Path) -> Path | None:
    candidates = [name] if name.endswith(".spec") else [name + ".spec", name]
    for base in (here, SPECS_DIR):
        for c in candidates:
            p = (base / c).resolve()
            if p.is_file():
                return p
    return None


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
