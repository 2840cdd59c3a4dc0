"""Find and load specs: a model family's logical tensors by its name, a user's own spec file by path.

A bare name (``llama``) is a model family (``reshard.models``): its logical tensors in the spec
language, what ``include llama`` in a spec gives. A ``specs/`` folder or a ``llama.spec`` in the
current directory never shadows it. A user's own spec is used only when named by path (it contains a
``/`` or ends in ``.spec``). The layouts of the formats (``megatron-llama``, ``hf-gpt2``, ...) are
derived from the families by ``reshard.formats.specs``.

``include NAME`` lines are expanded here (the parser itself never opens files): NAME is looked up
next to the including file, then among the shipped specs, with ``.spec`` appended when it has no suffix.
"""

from __future__ import annotations

from pathlib import Path

from reshard.core.spec import Include, Spec, parse_spec
from reshard.errors import SpecError
from reshard.models import FAMILIES, get_family

__all__ = ["available_specs", "load_spec"]


def available_specs() -> list[str]:
    """Names ``load_spec`` takes without a path: the model families."""
    return sorted(FAMILIES)


def load_spec(name_or_path: str | Path, _seen: tuple[Path, ...] = ()) -> Spec:
    """Parse a model family's logical tensors by its name, or a spec file by path, with its includes expanded.

    Raises:
      SpecError: the file is missing, includes itself, or does not parse.
    """
    text = str(name_or_path)
    by_path = isinstance(name_or_path, Path) or "/" in text or text.endswith(".spec")
    if not by_path and text in FAMILIES:
        family = get_family(text)
        return parse_spec(family.base_text, source=f"<family {text}>")
    path = _as_file(Path(text)) if by_path else None
    if path is None:
        where = f"no spec file {text}" if by_path else f"no model family '{text}'"
        raise SpecError(f"{where} (families: {', '.join(available_specs())}; a spec of your own is named by its "
                        "path; format layouts such as megatron-llama come from reshard.formats.specs)")
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
        target = _as_file(path.parent / st.path) or (st.path if st.path in FAMILIES else None)
        if target is None:
            raise spec.error(f"cannot find included spec '{st.path}' (looked next to {path.name} and among the "
                             f"model families: {', '.join(FAMILIES)})", st.pos)
        inner = load_spec(target, (*_seen, path))
        statements += inner.statements
        included += [(inner.source, inner.lines), *inner.included]
    return Spec(source=spec.source, statements=tuple(statements), lines=spec.lines, included=tuple(included))


def _as_file(path: Path) -> Path | None:
    for p in (path, path.with_name(path.name + ".spec")) if path.suffix != ".spec" else (path,):
        if p.is_file():
            return p.resolve()
    return None


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
