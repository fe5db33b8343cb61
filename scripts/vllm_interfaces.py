#!/usr/bin/env python3
"""Check kvengine's vLLM connector against vLLM releases' own Python sources, never importing vLLM.

    python scripts/vllm_interfaces.py [--download] 0.33.0 0.34.0   # releases by version (cached wheels)
    python scripts/vllm_interfaces.py path/to/site-packages-or.whl  # any source tree or wheel

What is checked is derived from the connector's code (``integrations/vllm/*.py``, parsed with ``ast``), so
it follows the connector as it changes:

* ``import``   every ``from vllm.M import N`` (module level, TYPE_CHECKING or local): ``N`` is defined in
  (or re-exported by) ``vllm/M``; for a class, its bases and decorators.
* ``method``   every method a kvengine class overrides (or reaches through ``super()``) on a vLLM base
  class: the base's signature, and that kvengine's override still accepts what vLLM passes.
* ``abstract`` the base classes' abstract methods are all implemented.
* ``attr``     attributes kvengine reads on vLLM objects: ``self.x`` inherited from a vLLM base, enum
  members, ``p.x.y`` on parameters (and names bound from them, loop variables over their lists)
  annotated with a vLLM class, ``spec.x`` under ``isinstance(spec, C)`` / ``type(spec) is C``, and
  :data:`DECLARED_READS`, the reads through untyped objects that ``ast`` cannot follow (listed by hand).
* ``backend``  for every attention backend ``layout.py`` names: the methods that decide its KV cache
  shape and stride order (inherited ones resolved), and vLLM's own shape and stride functions
  (:data:`SHAPE_FUNCTIONS`), as normalized source; ``layout.py``'s KV cache layouts as enum members.
* ``new``      public methods a release adds to a base class: each needs a decision in :data:`NEW_METHODS`.

Each interface is compared with the baseline, the installed vLLM the connector is validated on end to end
(``.venv-vllm``): same / changed (how) / missing. The run fails (exit 1), naming the interface, on anything
missing, incompatible with kvengine's override, changed and not reviewed (:data:`REVIEWED`), or new and
undecided. Interfaces of backends the connector refuses are reported, never failed.
"""

from __future__ import annotations

import argparse
import ast
import copy
import difflib
import hashlib
import importlib.util
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONNECTOR_DIR = ROOT / "integrations" / "vllm"
WHEEL_CACHE = Path.home() / ".cache" / "kvengine" / "vllm-wheels"

#: Reads through objects the connector holds untyped (``object`` parameters, ``getattr`` free), by hand:
#: (vLLM module, class, attribute chain, where kvengine reads it).
DECLARED_READS: tuple[tuple[str, str, str, str], ...] = (
    ("vllm.config", "VllmConfig", "compilation_config.enabled_custom_ops", "worker.py register_kv_caches"),
    ("vllm.config", "VllmConfig", "compilation_config.static_forward_context", "worker.py _layer_backends"),
    ("vllm.config", "VllmConfig", "cache_config.kv_cache_layout", "worker.py register_kv_caches"),
    ("vllm.config", "VllmConfig", "model_config.model", "identity.py"),
    ("vllm.config", "VllmConfig", "model_config.dtype", "identity.py"),
    ("vllm.config", "VllmConfig", "model_config.quantization", "identity.py"),
    ("vllm.config", "VllmConfig", "model_config.hf_config", "identity.py"),
    ("vllm.config", "VllmConfig", "model_config.revision", "identity.py"),
    ("vllm.config", "VllmConfig", "cache_config.cache_dtype", "identity.py"),
    ("vllm.config", "VllmConfig", "parallel_config.tensor_parallel_size", "identity.py, connector.py"),
    ("vllm.v1.kv_cache_interface", "KVCacheConfig", "num_blocks", "worker.py register_kv_caches"),
    ("vllm.v1.kv_cache_interface", "KVCacheConfig", "kv_cache_groups", "layout.py plan_groups"),
    ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", "kv_cache_spec", "layout.py plan_groups"),
    ("vllm.v1.kv_cache_interface", "KVCacheGroupSpec", "layer_names", "layout.py plan_groups"),
)

#: vLLM functions that turn a spec and a layout into the per-layer views kvengine copies pages through.
SHAPE_FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("vllm.v1.kv_cache_interface", "compute_layer_kv_cache_shape_bytes"),
    ("vllm.v1.kv_cache_interface", "compute_layout_strides"),
    ("vllm.v1.kv_cache_interface", "create_kv_cache_views"),
    ("vllm.v1.kv_cache_interface", "group_kernel_blocks"),
    ("vllm.v1.kv_cache_interface", "AttentionSpec.state_content_size_bytes"),
    ("vllm.v1.kv_cache_interface", "MambaSpec.state_content_size_bytes"),
    ("vllm.v1.kv_cache_layout", "KVCacheLayout.layer_view_order"),
)
#: The module of vLLM's KV cache spec classes: every class kvengine imports from it has its fields checked
#: (a new field may change what a page holds, e.g. quantization scales).
SPEC_MODULE = "vllm.v1.kv_cache_interface"
#: The backend methods that decide a backend's KV cache shape and stride order.
BACKEND_METHODS = ("get_kv_cache_shape", "get_kv_cache_stride_order", "supported_kv_cache_layouts",
                   "get_supported_kernel_block_sizes")

#: Base-class methods added after the baseline, and what kvengine does about each (read from the release's
#: default). A release adding another one fails until it is decided here.
NEW_METHODS: dict[str, str] = {
    "supports_lookahead_block_hashes": "inherited (False): vLLM hashes no prefill lookahead; kvengine refuses "
                                       "speculative decoding, the only user of it",
    "kv_cache_access": "inherited (IN_PROCESS): the worker copies pages through torch views in its own process; "
                       "no RDMA/UCX registration, no exported handles",
    "supports_sleep_mode": "implemented (False): sleep discards the KV cache and at level 2 the weights; weights "
                           "reloaded after wake-up would no longer match the namespace kvengine fingerprinted at "
                           "start-up, so vLLM refuses enable_sleep_mode with this connector (check_vllm_config "
                           "refuses it by name on 0.32 too)",
    "unregister_kv_caches": "inherited (no-op): copies never outlive their step and kvengine registers nothing "
                            "outside the process; reached only through sleep mode (refused) and the extensible KV "
                            "cache's weight update (a documented gap: weights changed in place)",
    "restore_kv_caches": "inherited (no-op): the counterpart of unregister_kv_caches",
    "may_load_async": "inherited (P/D do_remote_prefill flag, False here): kvengine's asynchronous loads "
                      "(multi-group models) start when a running slot is free, as on 0.32",
}

_STR_ENUM = "StrEnum is (str, Enum) by another name: members compare, hash and format the same"
_DRAFT = "is_draft marks speculative-decoding draft layers, and kvengine refuses speculative decoding"
_HEAD_MAJOR = ("kv_head_major_slots only orders the slots inside a page, which kvengine copies whole as bytes; "
               "the spec's repr (every field) is in the namespace")
#: Reviewed changes: interface id -> {digest of the release's descriptor: why kvengine is unaffected}.
#: A further change to the same interface fails again (its digest differs); the report prints the digest.
REVIEWED: dict[str, dict[str, str]] = {
    "import vllm.v1.metrics.cache_hit_source.CacheHitSource": {"763a781dfac6": _STR_ENUM},
    "attr vllm.v1.metrics.cache_hit_source.CacheHitSource.HOST": {"ab4da5b650ab": _STR_ENUM},
    "attr vllm.config.VllmConfig.cache_config.cache_dtype": {
        "f254f4ae921d": "the annotation widened to any string; check_vllm_config still accepts only 'auto'/None"},
    "attr vllm.v1.request.Request.prompt_token_ids": {
        "d03ea037c4e7": "an annotation was added (list[int] | None); kvengine already treats None as ineligible"},
    "fields vllm.v1.kv_cache_interface.KVCacheConfig": {
        "f15b400d7a16": "needs_kv_cache_zeroing is derived (init=False) and only tells vLLM to zero new blocks"},
    **{f"fields vllm.v1.kv_cache_interface.{cls}": {d33: _DRAFT, d34: f"{_DRAFT}; {_HEAD_MAJOR}"}
       for cls, d33, d34 in (("AttentionSpec", "08b6fed22a23", "bd3706856918"),
                             ("ChunkedLocalAttentionSpec", "acacc11948eb", "94f505070f24"),
                             ("FullAttentionSpec", "476f0f85215d", "f7e5a41326ad"),
                             ("SlidingWindowSpec", "4b34e791a508", "ca86a6599cae"))},
    "fields vllm.v1.kv_cache_interface.MLAAttentionSpec": {
        "2d88934d2ac1": f"{_DRAFT}; topk_buffer_width is the sparse top-k index buffer of sparse MLA models, "
                        "whose indexer cache is a spec class kvengine refuses",
        "5e08ecdbd53e": f"{_DRAFT}; {_HEAD_MAJOR}; topk_buffer_width: sparse MLA only (its indexer cache is "
                        "a spec class kvengine refuses)"},
    "fields vllm.v1.kv_cache_interface.MambaSpec": {
        "7e052c93273d": _DRAFT,
        "bca8ed4ecc6a": f"{_DRAFT}; state_alignment pads each state inside a block (see "
                        "MambaSpec.state_content_size_bytes)"},
    "shape vllm.v1.kv_cache_interface.MambaSpec.state_content_size_bytes": {
        "9ab4a7c79534": "each state is padded to state_alignment, as the layer lays them out "
                        "(mamba/abstract.py: offset += round_up(nbytes, alignment)); kvengine copies the first "
                        "state_content_size_bytes of each block, which still covers every state, and the padded "
                        "size is in the layout id"},
}


# ============================== release sources ==============================
class Release:
    """One vLLM release's Python sources (an installed ``vllm`` package or a wheel), parsed on demand."""

    def __init__(self, label: str, read: Callable[[str], str | None], paths: Callable[[], list[str]]) -> None:
        self.label = label
        self._read = read
        self._paths = paths
        self._trees: dict[str, tuple[ast.Module, bool] | None] = {}
        self._texts: dict[str, str | None] = {}
        self._backend_files: dict[str, list[str]] | None = None

    @classmethod
    def from_path(cls, path: Path, label: str | None = None) -> Release:
        """A wheel, a directory holding ``vllm/``, or the ``vllm`` package directory itself."""
        if path.is_file():
            wheel = zipfile.ZipFile(path)
            names = set(wheel.namelist())
            version = re.match(r"vllm-([^-]+)-", path.name)
            return cls(label or (version.group(1) if version else path.name),
                       lambda rel: wheel.read(rel).decode() if rel in names else None,
                       lambda: sorted(n for n in names if n.endswith(".py")))
        root = path.parent if path.name == "vllm" else path
        if not (root / "vllm").is_dir():
            raise SystemExit(f"vllm_interfaces: {path} holds no vllm package")

        def read(rel: str) -> str | None:
            p = root / rel
            return p.read_text() if p.is_file() else None

        return cls(label or _installed_version(root), read,
                   lambda: sorted(str(p.relative_to(root)) for p in (root / "vllm").rglob("*.py")))

    def module(self, name: str) -> tuple[ast.Module, bool] | None:
        """(tree, is_package) of module ``name``, None if the release has no such module."""
        if name not in self._trees:
            rel = name.replace(".", "/")
            found = None
            for path, is_pkg in ((f"{rel}.py", False), (f"{rel}/__init__.py", True)):
                text = self.read(path)
                if text is not None:
                    found = (ast.parse(text), is_pkg)
                    break
            self._trees[name] = found
        return self._trees[name]

    def paths(self) -> list[str]:
        return self._paths()

    def read(self, rel: str) -> str | None:
        if rel not in self._texts:
            self._texts[rel] = self._read(rel)
        return self._texts[rel]

    def backend_files(self, name: str) -> list[str]:
        """Files of attention code with a ``return "NAME"`` (where ``get_name`` answers ``NAME``)."""
        if self._backend_files is None:
            self._backend_files = {}
            for rel in self.paths():
                if rel.startswith("vllm/") and "attention" in rel and "/prefill/" not in rel:
                    for found in re.findall(r'return "([A-Z][A-Z0-9_]+)"', self.read(rel) or ""):
                        self._backend_files.setdefault(found, []).append(rel)
        return self._backend_files.get(name, [])

    def find(self, module: str, name: str, depth: int = 0) -> Found | None:
        """Where ``name`` is defined, seen from ``module`` (following ``from ... import`` re-exports)."""
        entry = self.module(module)
        if entry is None or depth > 10:
            return None
        tree, is_pkg = entry
        nodes = list(_top_level(tree.body))
        for node in nodes:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return Found(module, node)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return Found(module, node)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return Found(module, node)
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, is_pkg, node)
                        return self.find(source, alias.name, depth + 1) or (
                            Found(f"{source}.{alias.name}", self.module(f"{source}.{alias.name}")[0])  # type: ignore[index]
                            if self.module(f"{source}.{alias.name}") else None)
        return None

    def bases(self, cls: Found) -> list[Found]:
        """The vLLM classes ``cls`` derives from, resolved (unresolvable ones, e.g. ``ABC``, left out)."""
        out = []
        assert isinstance(cls.node, ast.ClassDef)
        for base in cls.node.bases:
            expr = base.value if isinstance(base, ast.Subscript) else base
            name = expr.id if isinstance(expr, ast.Name) else expr.attr if isinstance(expr, ast.Attribute) else None
            found = self.find(cls.module, name) if name else None
            if found is not None and isinstance(found.node, ast.ClassDef) and found.node is not cls.node:
                out.append(found)
        return out

    def mro(self, cls: Found) -> list[Found]:
        order: list[Found] = []
        stack = [cls]
        while stack:
            c = stack.pop(0)
            if all(c.node is not o.node for o in order):
                order.append(c)
                stack[0:0] = self.bases(c)
        return order

    def member(self, cls: Found, name: str) -> tuple[Found, ast.AST] | None:
        """The first definition of ``name`` along ``cls``'s bases: a method, a class-level or an instance
        (``self.name = ...``) attribute, with the class that defines it."""
        for c in self.mro(cls):
            assert isinstance(c.node, ast.ClassDef)
            for node in c.node.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return c, node
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                    return c, node
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                        for t in node.targets):
                    return c, node
            for node in ast.walk(c.node):
                target = node.target if isinstance(node, ast.AnnAssign) else None
                targets = node.targets if isinstance(node, ast.Assign) else [target] if target else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name) \
                            and t.value.id == "self":
                        return c, node
        return None


@dataclass(frozen=True, slots=True)
class Found:
    module: str
    node: ast.AST


def _top_level(body: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, including those under ``if``/``try`` (TYPE_CHECKING, fallbacks)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body)
            for h in node.handlers:
                yield from _top_level(h.body)


def _absolute(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_pkg else parts[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _installed_version(root: Path) -> str:
    for meta in root.glob("vllm*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return str(root)


# ============================== descriptors ==============================
def _text(node: ast.AST | None) -> str:
    """Source of an annotation or expression, string annotations unquoted."""
    return "" if node is None else re.sub(r"['\"]", "", ast.unparse(node))


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> list[str]:
    return [_text(d) for d in node.decorator_list]


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``[decorators] name(params) -> returns``, with parameter kinds, annotations and defaults."""
    a = fn.args
    parts: list[str] = []
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        parts.append(_param(arg, default))
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            parts.append("/")
    if a.vararg:
        parts.append("*" + _param(a.vararg, None))
    elif a.kwonlyargs:
        parts.append("*")
    parts += [_param(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        parts.append("**" + _param(a.kwarg, None))
    decorators = " ".join(f"@{d}" for d in _decorators(fn))
    return f"{decorators + ' ' if decorators else ''}{fn.name}({', '.join(parts)}) -> {_text(fn.returns)}"


def _param(arg: ast.arg, default: ast.expr | None) -> str:
    return arg.arg + (f": {_text(arg.annotation)}" if arg.annotation else "") + \
        (f" = {_text(default)}" if default is not None else "")


def body_source(node: ast.AST) -> str:
    """Normalized source (no docstrings, no comments) of a function or class."""
    node = copy.deepcopy(node)
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            n.body = body[1:] or [ast.Pass()]
    return ast.unparse(node)


def describe_member(owner: Found, node: ast.AST) -> str:
    """One attribute of a class as an interface: a method's signature, a field's annotation, a value."""
    where = f"{owner.module}.{owner.node.name}"  # type: ignore[attr-defined]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"{where}: {signature(node)}"
    if isinstance(node, ast.AnnAssign):
        target = node.target.attr if isinstance(node.target, ast.Attribute) else _text(node.target)
        instance = "instance " if isinstance(node.target, ast.Attribute) else ""
        return f"{where}: {instance}{target}: {_text(node.annotation)}"
    assert isinstance(node, ast.Assign)
    if any(isinstance(t, ast.Attribute) for t in node.targets):
        return f"{where}: instance attribute (untyped)"
    return f"{where}: {' = '.join(_text(t) for t in node.targets)} = {_text(node.value)}"


def describe_definition(found: Found) -> str:
    node = found.node
    if isinstance(node, ast.ClassDef):
        deco = " ".join(f"@{d}" for d in _decorators(node))
        return f"{found.module}: {deco + ' ' if deco else ''}class {node.name}({', '.join(map(_text, node.bases))})"
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"{found.module}: def {signature(node)}"
    if isinstance(node, ast.Module):
        return f"module {found.module}"
    return f"{found.module}: {type(node).__name__.lower()}"


def element_type(annotation: str) -> str | None:
    """``list[T]`` / ``Sequence[T]`` / ``tuple[T, ...]`` / ``set[T]`` -> ``T``."""
    m = re.fullmatch(r"(?:list|List|Sequence|Iterable|set|tuple|Tuple|frozenset)\[(\w+)(?:, \.\.\.)?\]", annotation)
    return m.group(1) if m else None


def class_named(annotation: str) -> str | None:
    """The class an annotation names, ``| None`` / ``Optional[...]`` dropped (None: not one plain class)."""
    parts = [p.strip() for p in annotation.split("|") if p.strip() != "None"]
    if len(parts) != 1:
        return None
    m = re.fullmatch(r"(?:Optional\[)?([A-Za-z_]\w*)\]?", parts[0])
    return m.group(1) if m else None


def resolve_chain(release: Release, module: str, name: str, attrs: tuple[str, ...]) -> str | None:
    """Describe ``Class.a.b...`` step by step in ``release`` (``[]``: an element of the list before it);
    None if any step is missing. A step whose type is not one plain class ends the walk (described so)."""
    found = release.find(module, name)
    if found is None or not isinstance(found.node, ast.ClassDef):
        return None
    steps = [describe_definition(found)]
    annotation: str | None = None
    for i, attr in enumerate(attrs):
        if attr == "[]":
            inner = element_type(annotation or "")
            found = release.find(found.module, inner) if inner else None
            if found is None or not isinstance(found.node, ast.ClassDef):
                steps.append(f"[] of {annotation!r}: element type not followed")
                break
            steps.append(f"[]: {describe_definition(found)}")
            continue
        member = release.member(found, attr)
        if member is None and attr in ("name", "value") and any(
                "Enum" in _text(b) for c in release.mro(found) for b in c.node.bases):  # type: ignore[attr-defined]
            steps.append(f"{attr}: Enum's own")
            break
        if member is None:
            return None
        owner, node = member
        steps.append(describe_member(owner, node))
        if i == len(attrs) - 1:
            break
        annotation = _text(node.returns) if isinstance(node, ast.FunctionDef) and \
            "property" in _decorators(node) else _text(node.annotation) if isinstance(node, ast.AnnAssign) else None
        if attrs[i + 1] == "[]":
            continue
        cls_name = class_named(annotation or "")
        nxt = release.find(owner.module, cls_name) if cls_name else None
        if nxt is None or not isinstance(nxt.node, ast.ClassDef):
            steps.append(f"type {annotation!r} not followed")
            break
        found = nxt
    return "\n".join(steps)


def find_backend(release: Release, name: str) -> Found | None:
    """The attention backend class whose ``get_name()`` returns ``name``."""
    for rel in release.backend_files(name):
        module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        entry = release.module(module)
        assert entry is not None
        for node in ast.walk(entry[0]):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Backend"):
                for fn in node.body:
                    if isinstance(fn, ast.FunctionDef) and fn.name == "get_name" and any(
                            isinstance(r, ast.Return) and isinstance(r.value, ast.Constant) and r.value.value == name
                            for r in ast.walk(fn)):
                        return Found(module, node)
    return None


def describe_source(release: Release, module: str, dotted: str) -> str | None:
    """Normalized source of ``module.Func`` or ``module.Class.method`` (inherited methods resolved)."""
    head, _, method = dotted.partition(".")
    found = release.find(module, head)
    if found is None:
        return None
    if not method:
        return f"{found.module}:\n{body_source(found.node)}"
    member = release.member(found, method)
    if member is None:
        return None
    owner, node = member
    return f"{owner.module}.{owner.node.name}:\n{body_source(node)}"  # type: ignore[attr-defined]


# ============================== interfaces, from kvengine's connector ==============================
@dataclass(frozen=True, slots=True)
class Interface:
    """One thing the connector relies on, with how to describe it in a release (None: missing)."""

    id: str
    kind: str
    where: str
    probe: Callable[[Release], str | None] = field(compare=False, repr=False)
    #: a failure of this interface fails the run (False: reported only, e.g. refused backends)
    fatal: bool = True
    #: kvengine overrides a method the baseline lacks: absent in a release means unused, not missing
    optional: bool = False
    #: for overrides: why kvengine's override no longer fits the release's base method ('' if it does)
    compat: Callable[[Release], str] | None = field(default=None, compare=False, repr=False)
    #: alternatives across releases (reads under one ``hasattr`` test): at least one must exist
    group: str = ""


def _vllm_imports(tree: ast.Module) -> dict[str, tuple[str, str]]:
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm" and not node.level:
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module or "", alias.name)
    return out


def connector_interfaces(connector_dir: Path, baseline: Release) -> list[Interface]:
    """Everything the connector in ``connector_dir`` implements on and reads from vLLM."""
    found: dict[str, Interface] = {}

    def add(iface: Interface) -> None:
        found.setdefault(iface.id, iface)

    for path in sorted(connector_dir.glob("*.py")):
        tree = ast.parse(path.read_text())
        imports = _vllm_imports(tree)
        where = path.name
        for module, name in imports.values():
            add(Interface(f"import {module}.{name}", "import", where,
                          lambda r, m=module, n=name: (lambda f: describe_definition(f) if f else None)(r.find(m, n))))
            if module == SPEC_MODULE:
                add(Interface(f"fields {module}.{name}", "fields", where, lambda r, m=module, n=name: _fields(r, m, n)))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                _class_interfaces(node, imports, where, baseline, add)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for root, attrs, group in _typed_reads(node, imports, _class_types(tree, node, imports)):
                    _add_read(add, imports[root], attrs, where, group)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imports:
                _add_read(add, imports[node.value.id], (node.attr,), where)
    for module, name, chain, where in DECLARED_READS:
        _add_read(add, (module, name), tuple(chain.split(".")), f"{where} (declared)")
    _backend_interfaces(connector_dir / "layout.py", add)
    return list(found.values())


def _add_read(add: Callable[[Interface], None], root: tuple[str, str], attrs: tuple[str, ...], where: str,
              group: str = "") -> None:
    module, name = root
    add(Interface(f"attr {module}.{name}.{'.'.join(attrs)}", "attr", where,
                  lambda r, m=module, n=name, a=attrs: resolve_chain(r, m, n, a), optional=bool(group),
                  group=group))


def _class_types(tree: ast.Module, fn: ast.AST, imports: dict[str, tuple[str, str]]) -> dict[str, str]:
    """``self.x`` of the class enclosing ``fn`` annotated with a vLLM class: ``{"self.x": local name}``."""
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and fn in cls.body:
            out = {}
            for node in ast.walk(cls):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute) and \
                        isinstance(node.target.value, ast.Name) and node.target.value.id == "self":
                    name = class_named(_text(node.annotation))
                    if name in imports:
                        out[f"self.{node.target.attr}"] = name
            return out
    return {}


def _chain(expr: ast.expr) -> tuple[str, tuple[str, ...]] | None:
    """``a.b.c`` -> ("a", ("b", "c")); ``self.x.b`` -> ("self.x", ("b",))."""
    attrs: list[str] = []
    while isinstance(expr, ast.Attribute):
        attrs.insert(0, expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    if expr.id == "self" and attrs:
        return f"self.{attrs[0]}", tuple(attrs[1:])
    return expr.id, tuple(attrs)


def _typed_reads(fn: ast.FunctionDef | ast.AsyncFunctionDef, imports: dict[str, tuple[str, str]],
                 self_types: dict[str, str]) -> Iterator[tuple[str, tuple[str, ...], str]]:
    """(imported class name, attribute chain, alternatives group) for each read on a value of a known vLLM
    type in ``fn``. Reads under ``if hasattr(x, "a")`` (or ``... if hasattr(x, "a") else ...``) are
    alternatives across releases: the group names the test, and one of its reads must exist."""
    env: dict[str, tuple[str, tuple[str, ...]]] = {k: (v, ()) for k, v in self_types.items()}
    for arg in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
        name = class_named(_text(arg.annotation)) if arg.annotation else None
        if name in imports:
            env[arg.arg] = (name, ())  # type: ignore[index]

    def typed(expr: ast.expr) -> tuple[str, tuple[str, ...]] | None:
        c = _chain(expr)
        if c is None or c[0] not in env:
            return None
        root, prefix = env[c[0]]
        return root, prefix + c[1]

    for node in ast.walk(fn):  # bindings: x = typed.attr, for x in typed.list, narrowing of spec-like names
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            t = typed(node.value)
            if t is not None and t[1]:
                env[node.targets[0].id] = t
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            t = typed(node.iter)
            if t is not None and t[1]:
                env[node.target.id] = (t[0], t[1] + ("[]",))
    narrowed: list[tuple[ast.AST, str, str]] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.If):
            test = node.test
            if isinstance(test, ast.Call) and _text(test.func) == "isinstance" and len(test.args) == 2 and \
                    isinstance(test.args[0], ast.Name) and isinstance(test.args[1], ast.Name):
                narrowed.append((node, test.args[0].id, test.args[1].id))
            if isinstance(test, ast.Compare) and isinstance(test.left, ast.Call) and _text(test.left.func) == "type" \
                    and isinstance(test.ops[0], ast.Is) and isinstance(test.comparators[0], ast.Name) and \
                    isinstance(test.left.args[0], ast.Name):
                narrowed.append((node, test.left.args[0].id, test.comparators[0].id))
    for if_node, var, cls in narrowed:
        if cls not in imports:
            continue
        for stmt in if_node.body:  # type: ignore[attr-defined]
            for node in ast.walk(stmt):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == var:
                    yield cls, (node.attr,), ""
    groups: dict[int, str] = {}
    for node in ast.walk(fn):
        test = getattr(node, "test", None) if isinstance(node, (ast.If, ast.IfExp)) else None
        if isinstance(test, ast.Call) and _text(test.func) == "hasattr" and len(test.args) == 2 and \
                typed(test.args[0]) is not None:
            for inner in ast.walk(node):
                groups.setdefault(id(inner), f"{fn.name}: {_text(test)}")
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
            t = typed(node)
            if t is not None and t[1] and not _is_prefix(node, fn):
                yield t[0], t[1], groups.get(id(node), "")


def _is_prefix(node: ast.Attribute, fn: ast.AST) -> bool:
    """Whether ``node`` is the object of a longer attribute chain (only the full chain is recorded)."""
    return any(isinstance(n, ast.Attribute) and n.value is node for n in ast.walk(fn))


def _class_interfaces(cls: ast.ClassDef, imports: dict[str, tuple[str, str]], where: str, baseline: Release,
                      add: Callable[[Interface], None]) -> None:
    """A kvengine class deriving from vLLM classes: its overrides, inherited reads, abstract methods."""
    bases = [imports[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in imports]
    if not bases:
        return
    own_methods = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    own_attrs = set(own_methods)
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Name):
                own_attrs.add(t.id)
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                own_attrs.add(t.attr)
    class_level = {t.id for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                   for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}

    def owner_in(release: Release, name: str) -> tuple[Found, ast.AST] | None:
        for module, base in bases:
            found = release.find(module, base)
            if found is not None and isinstance(found.node, ast.ClassDef):
                member = release.member(found, name)
                if member is not None:
                    return member
        return None

    def member_probe(name: str) -> Callable[[Release], str | None]:
        return lambda r: (lambda m: describe_member(*m) if m else None)(owner_in(r, name))

    label = "+".join(b for _, b in bases)
    for name, fn in own_methods.items():
        if name.startswith("_") and name != "__init__":
            continue
        in_baseline = owner_in(baseline, name) is not None
        if name == "__init__" and not in_baseline:
            continue
        add(Interface(f"method {label}.{name} ({cls.name})", "method", where, member_probe(name),
                      optional=not in_baseline, compat=lambda r, n=name, f=fn: _compat(owner_in(r, n), f)))
    reads = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" and \
                node.attr not in own_attrs:
            reads.add(node.attr)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call) and _text(node.value.func) == "super":
            reads.add(node.attr)
    for name in sorted(reads | (class_level & {n for n in class_level if owner_in(baseline, n)})):
        add(Interface(f"attr {label}.{name} ({cls.name})", "attr", where, member_probe(name)))
    add(Interface(f"abstract {label} ({cls.name})", "abstract", where,
                  lambda r: _unimplemented(r, bases, own_attrs)))
    add(Interface(f"new {label} ({cls.name})", "new", where,
                  lambda r: _public_methods(r, bases)))


def _compat(member: tuple[Found, ast.AST] | None, ours: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """Why kvengine's override cannot take vLLM's calls of the base method ('' if it can)."""
    if member is None or not isinstance(member[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return ""
    base = member[1]
    kinds = ("classmethod", "staticmethod", "property")
    bk = [d for d in _decorators(base) if d in kinds]
    ok = [d for d in _decorators(ours) if d in kinds]
    if bk != ok:
        return f"vLLM's is {bk or 'a plain method'}, kvengine's {ok or 'a plain method'}"
    ours_pos = [a.arg for a in [*ours.args.posonlyargs, *ours.args.args]]
    ours_names = set(ours_pos) | {a.arg for a in ours.args.kwonlyargs}
    base_pos = [a.arg for a in [*base.args.posonlyargs, *base.args.args]]
    problems = []
    for i, name in enumerate(base_pos[1:] if base_pos and base_pos[0] in ("self", "cls") else base_pos):
        j = i + (1 if ours_pos and ours_pos[0] in ("self", "cls") else 0)
        if name not in ours_names and ours.args.kwarg is None and (j >= len(ours_pos) and ours.args.vararg is None):
            problems.append(f"vLLM passes {name!r}, kvengine's override has no such parameter")
    for a in base.args.kwonlyargs:
        if a.arg not in ours_names and ours.args.kwarg is None:
            problems.append(f"vLLM passes keyword {a.arg!r}, kvengine's override has no such parameter")
    base_names = set(base_pos) | {a.arg for a in base.args.kwonlyargs}
    required = ours.args.args[:len(ours.args.args) - len(ours.args.defaults)]
    for a in required:
        if a.arg not in base_names and a.arg not in ("self", "cls"):
            problems.append(f"kvengine's override requires {a.arg!r}, which vLLM's signature no longer has")
    return "; ".join(problems)


def _unimplemented(release: Release, bases: list[tuple[str, str]], own: set[str]) -> str | None:
    """Abstract methods of the bases that kvengine's class does not define ('none' if all are)."""
    missing: set[str] = set()
    defined = set(own)
    for module, name in bases:
        found = release.find(module, name)
        if found is None:
            return None
        seen: set[str] = set()
        for c in release.mro(found):
            for node in c.node.body:  # type: ignore[attr-defined]
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in seen:
                    seen.add(node.name)
                    if "abstractmethod" in _decorators(node) or "abc.abstractmethod" in _decorators(node):
                        missing.add(node.name)
                    else:
                        defined.add(node.name)
    left = sorted(missing - defined)
    return ", ".join(left) if left else "none"


def _fields(release: Release, module: str, name: str) -> str | None:
    """A class's fields along its bases (``name: annotation = default``), one per line; None if missing."""
    found = release.find(module, name)
    if found is None or not isinstance(found.node, ast.ClassDef):
        return None
    fields: dict[str, str] = {}
    for c in reversed(release.mro(found)):
        for node in c.node.body:  # type: ignore[attr-defined]
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                default = f" = {_text(node.value)}" if node.value is not None else ""
                fields[node.target.id] = f"{node.target.id}: {_text(node.annotation)}{default}"
    return "\n".join(fields[k] for k in sorted(fields)) or "no fields"


def _public_methods(release: Release, bases: list[tuple[str, str]]) -> str | None:
    names: set[str] = set()
    for module, name in bases:
        found = release.find(module, name)
        if found is None:
            return None
        for c in release.mro(found):
            names |= {n.name for n in c.node.body  # type: ignore[attr-defined]
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")}
    return ", ".join(sorted(names))


def _literal_names(tree: ast.Module, variable: str) -> list[str]:
    """The UPPER_CASE string constants in the value assigned to ``variable`` (backend and layout names)."""
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0] \
            if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id == variable and node.value is not None:  # type: ignore[union-attr]
            names = [n.value for n in ast.walk(node.value) if isinstance(n, ast.Constant)  # type: ignore[union-attr]
                     and isinstance(n.value, str) and re.fullmatch(r"[A-Z][A-Z0-9_]+", n.value)]
            return list(dict.fromkeys(names))
    raise SystemExit(f"vllm_interfaces: layout.py no longer assigns {variable}")


def _backend_interfaces(layout_py: Path, add: Callable[[Interface], None]) -> None:
    tree = ast.parse(layout_py.read_text())
    validated = _literal_names(tree, "ATTENTION_BACKENDS") + _literal_names(tree, "STATE_BACKENDS")
    # refused, or accepted only with a verification record of the running platform: checked, not fatal
    refused = [n for n in _literal_names(tree, "PROVABLE_BACKENDS") + _literal_names(tree, "REFUSED_BACKENDS")
               if n not in validated]
    for name in [*validated, *refused]:
        fatal = name in validated
        add(Interface(f"backend {name}", "backend", "layout.py", lambda r, n=name: (
            lambda f: describe_definition(f) if f else None)(find_backend(r, n)), fatal=fatal))
        for method in BACKEND_METHODS:
            add(Interface(f"backend {name}.{method}", "backend", "layout.py",
                          lambda r, n=name, m=method: _backend_method(r, n, m), fatal=fatal))
    for module, dotted in SHAPE_FUNCTIONS:
        add(Interface(f"shape {module}.{dotted}", "backend", "paging through vLLM's views",
                      lambda r, m=module, d=dotted: describe_source(r, m, d)))
    for member in _literal_names(tree, "KV_LAYOUTS"):
        _add_read(add, ("vllm.v1.kv_cache_layout", "KVCacheLayout"), (member,), "layout.py KV_LAYOUTS")


def _backend_method(release: Release, backend: str, method: str) -> str | None:
    found = find_backend(release, backend)
    if found is None:
        return None
    member = release.member(found, method)
    if member is None:
        return "not defined (vLLM builds the views from the spec and layout)"
    owner, node = member
    return f"{owner.module}.{owner.node.name}:\n{body_source(node)}"  # type: ignore[attr-defined]


# ============================== comparison ==============================
@dataclass(frozen=True, slots=True)
class Finding:
    interface: Interface
    status: str  # same | changed | missing | absent | reviewed | new | info
    detail: str
    fails: bool


def digest(descriptor: str) -> str:
    return hashlib.sha256(descriptor.encode()).hexdigest()[:12]


def compare(interfaces: list[Interface], baseline: Release, release: Release) -> list[Finding]:
    out = []
    for iface in interfaces:
        base, rel = iface.probe(baseline), iface.probe(release)
        if iface.kind == "new":
            added = sorted(set((rel or "").split(", ")) - set((base or "").split(", ")) - {""})
            undecided = [m for m in added if m not in NEW_METHODS]
            detail = "; ".join(f"{m}: {NEW_METHODS.get(m, 'UNDECIDED: decide in NEW_METHODS')}" for m in added)
            out.append(Finding(iface, "new" if added else "same", detail or "no new methods", bool(undecided)))
            continue
        compat = iface.compat(release) if iface.compat is not None and rel is not None else ""
        if rel is None:
            status, detail = ("absent", "not in this release (an alternative for other releases)"
                              if iface.group else "not in this release (kvengine's override unused)") \
                if iface.optional else ("missing", "not found")
        elif base == rel or (base is None and iface.optional):
            status, detail = "same", ""
        elif digest(rel) in REVIEWED.get(iface.id, {}):
            status, detail = "reviewed", REVIEWED[iface.id][digest(rel)]
        else:
            status, detail = "changed", _diff(base or "", rel)
        if compat:
            status, detail = "incompatible", compat
        fails = iface.fatal and status in ("missing", "changed", "incompatible")
        out.append(Finding(iface, status if iface.fatal or status == "same" else f"{status} (refused backend)",
                           detail, fails))
    for group in {f.interface.group for f in out if f.interface.group}:
        members = [i for i, f in enumerate(out) if f.interface.group == group]
        if all(out[i].status == "absent" for i in members):
            names = ", ".join(out[i].interface.id for i in members)
            for i in members:
                out[i] = Finding(out[i].interface, "missing", f"none of the alternatives under {group} "
                                                              f"exists ({names})", True)
    return out


def _diff(a: str, b: str) -> str:
    lines = [ln for ln in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
             if not ln.startswith(("---", "+++", "@@"))]
    return "\n".join(lines[:12]) + (f"\n... {len(lines) - 12} more lines" if len(lines) > 12 else "") + \
        f"\n(descriptor digest {digest(b)})"


def report(release: Release, findings: list[Finding], *, verbose: bool = False) -> str:
    counts: dict[str, int] = {}
    lines = []
    for f in findings:
        counts[f.status] = counts.get(f.status, 0) + 1
        if f.fails or verbose or f.status not in ("same", "absent"):
            mark = "FAIL" if f.fails else "ok  "
            detail = ("\n" + "\n".join("      " + ln for ln in f.detail.splitlines())) if f.detail else ""
            lines.append(f"  {mark} {f.interface.id} [{f.interface.where}]: {f.status}{detail}")
    failed = sum(f.fails for f in findings)
    head = f"vLLM {release.label}: {len(findings)} interfaces, " + \
        ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + (f"; {failed} FAIL" if failed else "; pass")
    return "\n".join([head, *lines])


# ============================== entry point ==============================
def find_baseline() -> Path:
    """The vLLM the connector runs end to end on: this interpreter's, else ``.venv-vllm``'s."""
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    for p in sorted(ROOT.glob(".venv-vllm/lib/python*/site-packages/vllm")):
        return p
    raise SystemExit("vllm_interfaces: no installed vLLM to compare with (run scripts/setup_vllm.sh, or --baseline)")


def wheel_for(version: str, cache: Path, download: bool) -> Path:
    """The cached wheel of ``vllm==version``, downloaded (no install, no dependencies) when asked."""
    cached = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if cached:
        return cached[0]
    if not download:
        raise SystemExit(f"vllm_interfaces: no cached wheel for vllm {version} in {cache} (use --download)")
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", f"vllm=={version}",
           "-d", str(cache)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    cached = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if result.returncode or not cached:
        raise SystemExit(f"vllm_interfaces: could not download vllm {version}: {' '.join(cmd)} exited "
                         f"{result.returncode}\n{result.stderr[-2000:]}")
    return cached[0]


def check(release: Release, baseline: Release, connector_dir: Path = CONNECTOR_DIR) -> list[Finding]:
    """Every interface of the connector in ``connector_dir``, in ``release`` against ``baseline``."""
    return compare(connector_interfaces(connector_dir, baseline), baseline, release)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("releases", nargs="+", help="vLLM versions (cached wheels) or paths to wheels/source trees")
    parser.add_argument("--baseline", type=Path, help="the validated vLLM's sources (default: installed)")
    parser.add_argument("--connector", type=Path, default=CONNECTOR_DIR, help="the connector's sources")
    parser.add_argument("--wheel-cache", type=Path, default=WHEEL_CACHE)
    parser.add_argument("--download", action="store_true", help="download missing wheels (pip download)")
    parser.add_argument("-v", "--verbose", action="store_true", help="list unchanged interfaces too")
    args = parser.parse_args(argv)
    start = time.monotonic()
    baseline = Release.from_path(args.baseline or find_baseline())
    interfaces = connector_interfaces(args.connector, baseline)
    own = compare(interfaces, baseline, baseline)
    broken = [f for f in own if f.status == "missing" and not f.interface.optional]
    status = 0
    if broken:
        print(f"vllm_interfaces: the baseline {baseline.label} lacks what the connector uses:\n" +
              "\n".join(f"  {f.interface.id} [{f.interface.where}]" for f in broken))
        status = 1
    for spec in args.releases:
        path = Path(spec) if "/" in spec or spec.endswith(".whl") else wheel_for(spec, args.wheel_cache, args.download)
        release = Release.from_path(path)
        findings = compare(interfaces, baseline, release)
        print(report(release, findings, verbose=args.verbose))
        status |= any(f.fails for f in findings)
    print(f"vllm_interfaces: baseline {baseline.label}, {len(interfaces)} interfaces, "
          f"{time.monotonic() - start:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
