"""The fork's own save functions: their parameters, what each one means, and where they save.

dsfix's public functions take the checkout's own parameter list, so every call that bound to
``save_hf_format`` or ``save_zero_three_model`` binds to dsfix's function the same way. What each
parameter means is read from the original definition:

* model: the first positional parameter; tokenizer: a parameter whose name contains "tokenizer";
  rank: ``global_rank`` or ``rank``; ZeRO stage: ``zero_stage`` or ``stage``; ``args``: the options.
* where: the folder the original writes to, and the statements that compute it (if/elif/else included),
  carried as the fork's own (patcher.patch.folder), so dsfix saves exactly where the original did.
* which keys it leaves out: read from its tests on the key name (patcher.patch.keyfilter).
* any other parameter: accepted and unused when the original never reads it (a note says so), carried
  when it only feeds the folder, and refused when the original reads it for anything else, since dsfix
  cannot tell what it changes.

``bind`` checks a call against a parameter list the way ``inspect.Signature.bind`` would.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from dataclasses import dataclass

import libcst as cst

from patcher.patch import calls, folder, keyfilter
from patcher.errors import DsfixError
from patcher.patch.names import CORE, RENAMES

EXTRAS = ("max_shard_size", "strategy")  # dsfix's own keyword-only options
RANK_NAMES = ("global_rank", "rank")
STAGE_NAMES = ("zero_stage", "stage")
_EMPTY = cst.Module([])


def code(node) -> str:
    return _EMPTY.code_for_node(node)


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # "posonly", "pos", "varpos", "kwonly", "varkw"
    has_default: bool
    text: str  # as written, without the comma ("sub_folder=''", "*args")


@dataclass(frozen=True)
class SaveDef:
    """One of the checkout's save functions, read for what dsfix's replacement must do."""

    name: str  # "save_hf_format" or "save_zero_three_model"
    params: tuple  # of Param
    line: int
    where: tuple = ()  # the statements (source text) that compute the folder, copied into dsfix's function
    folder: str = "output_dir"  # the expression for the folder, after those statements
    passed: tuple = ()  # (core keyword, expression) pairs besides model and folder
    notes: tuple = ()
    default: bool = False  # True: the template's own (upstream's) definition
    missing: bool = False  # True: the checkout's utils.py binds no such name at all (a use of it fails today)
    writes: frozenset = frozenset({"weights", "config", "tokenizer"})  # what the original saves
    drop: str | None = None  # dsfix's drop= for the keys the original leaves out (None: upstream's "lora" rule)

    def header(self, new_name: str) -> str:
        taken = {p.name for p in self.params}
        parts, star = [], False
        for i, p in enumerate(self.params):
            if p.kind in ("varpos", "kwonly") and not star:
                star = True
                if p.kind == "kwonly":
                    parts.append("*")
            if p.kind == "varkw":
                extras = [f"{e}=None" for e in EXTRAS if e not in taken]
                if extras and not star:
                    parts.append("*")
                parts += extras
                taken.update(EXTRAS)
            parts.append(p.text)
            if p.kind == "posonly" and (i + 1 == len(self.params) or self.params[i + 1].kind != "posonly"):
                parts.append("/")
        extras = [f"{e}=None" for e in EXTRAS if e not in taken]
        if extras and not star:
            parts.append("*")
        parts += extras
        return f"def {new_name}({', '.join(parts)}):"


# ----------------------------------------------------------------------------- reading a definition


def _params(fn: cst.FunctionDef) -> tuple:
    ps = fn.params
    out = []

    def text(p: cst.Param) -> str:
        return " ".join(code(p.with_changes(comma=cst.MaybeSentinel.DEFAULT,
                                            whitespace_after_param=cst.SimpleWhitespace(""))).split())

    for p in ps.posonly_params:
        out.append(Param(p.name.value, "posonly", p.default is not None, text(p)))
    for p in ps.params:
        out.append(Param(p.name.value, "pos", p.default is not None, text(p)))
    if isinstance(ps.star_arg, cst.Param):
        out.append(Param(ps.star_arg.name.value, "varpos", False, text(ps.star_arg)))
    for p in ps.kwonly_params:
        out.append(Param(p.name.value, "kwonly", p.default is not None, text(p)))
    if ps.star_kwarg is not None:
        out.append(Param(ps.star_kwarg.name.value, "varkw", False, text(ps.star_kwarg)))
    return tuple(out)


def reads(node) -> set:
    return folder.reads(node)


def _body(fn: cst.FunctionDef) -> list:
    body = list(fn.body.body) if isinstance(fn.body, cst.IndentedBlock) else list(fn.body.body)
    if body and isinstance(body[0], cst.SimpleStatementLine) and isinstance(body[0].body[0], cst.Expr) \
            and isinstance(body[0].body[0].value, (cst.SimpleString, cst.ConcatenatedString)):
        body = body[1:]  # the docstring
    return body


def _writes(fn: ast.FunctionDef) -> frozenset:
    """What the function saves: a subset of {"weights", "config", "tokenizer"}, read with ast (a libcst pass
    over the body costs ten times more)."""
    out = set()
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        method = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        receiver = ast.unparse(func.value).lower() if isinstance(func, ast.Attribute) else ""
        first = ast.unparse(node.args[0]) if node.args else ""
        if method in ("save", "save_file", "save_model", "save_checkpoint") and "args" not in first or (
                method == "save_pretrained" and "tokenizer" not in receiver and "config" not in receiver):
            out.add("weights")  # (torch.save(vars(args), ...) saves the options, not weights)
        if method == "to_json_file" or (method == "save_pretrained" and "tokenizer" not in receiver):
            out.add("config")
        if "tokenizer" in receiver and method in ("save_vocabulary", "save_pretrained"):
            out.add("tokenizer")
    return frozenset(out)


def read_def(fn: cst.FunctionDef, rel: str, line: int | None, fn_ast: ast.FunctionDef = None, source=None,
             aliases: dict | None = None) -> SaveDef:
    """What dsfix's replacement of ``fn`` must take, pass and copy; refuses what it cannot carry over.
    ``fn_ast``/``source``: the same function parsed by ast and its file's text (calls.Source), for line
    numbers; ``aliases``: the module's top-level imports (folder.module_aliases)."""
    name = fn.name.value
    params = _params(fn)
    positional = [p for p in params if p.kind in ("posonly", "pos")]
    if not positional:
        raise DsfixError(f"{name} takes no positional model parameter", path=rel, line=line)
    if fn_ast is None or source is None:
        text = code(fn.with_changes(leading_lines=[], decorators=[]))
        fn_ast, source, line = ast.parse(text).body[0], calls.Source(text), line if line else None
    names = {p.name for p in params}
    lines = folder.Lines(fn, line)
    body = _body(fn)
    where = folder.read_folder(fn, body, names, aliases if aliases is not None else {"os": "os"}, lines, rel)
    writes = _writes(fn_ast)
    if name == "save_hf_format" and "weights" not in writes:
        raise DsfixError(f"{name} saves no weights (no torch.save, save_file or save_pretrained of the model in "
                         "it): there is nothing in it for dsfix to turn into safetensors", path=rel, line=line)
    try:
        keys = keyfilter.read_filter(fn_ast, source, names)
    except keyfilter.Refused as e:
        raise DsfixError(f"{name} {e.message}; dsfix leaves out only keys it can test by name as the fork does "
                         "(in, ==, startswith, endswith, and/or/not): rewrite that test so", path=rel,
                         line=e.line) from None
    where_reads = set(where.reads)
    other_reads = set().union(*(folder.reads(s, where.carried) for s in body)) if body else set()
    other_reads -= keys.params  # read by the key test, which dsfix's save carries
    model = positional[0].name
    roles, notes, passed = {model: "model"}, [], []
    for p in params[1:] if params[0].name == model else params:
        if p.name == model:
            continue
        read_elsewhere = p.name in other_reads
        if "tokenizer" in p.name:
            role = "tokenizer"
        elif p.name in RANK_NAMES:
            role = "rank"
        elif p.name in STAGE_NAMES:
            role = "stage"
        elif p.name == "args":
            role = "args"
        elif p.name in where_reads:
            role = "where"
        else:
            role = "unknown"
        if role in ("tokenizer", "rank", "stage") and not read_elsewhere and p.name not in where_reads:
            notes.append(f"{name}'s parameter {p.name} is accepted and unused: the original never reads it")
            continue
        if role == "tokenizer":
            passed.append(("tokenizer", p.name))
        elif role == "rank":
            passed.append(("global_rank", p.name))
        elif role == "stage" and name == "save_zero_three_model":
            passed.append(("zero_stage", p.name))
        elif role == "unknown":
            if read_elsewhere:
                raise DsfixError(
                    f"{name}'s parameter {p.name} changes what the original does (it is read outside the folder "
                    "computation), and dsfix cannot tell how; it refuses rather than save something else",
                    path=rel, line=line)
            if p.kind not in ("varpos", "varkw"):
                notes.append(f"{name}'s parameter {p.name} is accepted and unused: the original never reads it")
        elif role == "where" and p.name not in where_reads:
            pass
        roles[p.name] = role
    if name == "save_hf_format" and "global_rank" not in dict(passed):
        text = code(fn)
        if "GatheredParameters" in text or "gather_16bit" in text:
            raise DsfixError(f"{name} gathers ZeRO-3 parameters itself but takes no rank parameter, so dsfix cannot "
                             "tell which rank writes", path=rel, line=line)
    if name == "save_zero_three_model" and "global_rank" not in dict(passed):
        raise DsfixError(f"{name} takes no global_rank (or rank) parameter that it reads; dsfix needs it to tell "
                         "which rank writes", path=rel, line=line)
    return SaveDef(name, params, line, where.statements, where.expression, tuple(passed), tuple(notes),
                   writes=writes, drop=keys.argument())


@functools.lru_cache(maxsize=None)
def default_def(name: str) -> SaveDef:
    """Upstream's definition, for a checkout that lacks the function (its replacement is the template's)."""
    sigs = {
        "save_hf_format": "def save_hf_format(model, tokenizer, args, sub_folder=''):\n"
                          "    output_dir = os.path.join(args.output_dir, sub_folder)\n    os.makedirs(output_dir)\n"
                          "    sd = {k: v for k, v in model.state_dict().items() if 'lora' not in k}\n"
                          "    torch.save(sd, os.path.join(output_dir, 'pytorch_model.bin'))\n"
                          "    model.config.to_json_file(os.path.join(output_dir, 'config.json'))\n"
                          "    tokenizer.save_vocabulary(output_dir)\n",
        "save_zero_three_model": "def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):\n"
                                 "    zero_stage_3 = (zero_stage == 3)\n    os.makedirs(save_dir, exist_ok=True)\n"
                                 "    sd = {k: v for k, v in model_ema.named_parameters() if 'lora' not in k}\n"
                                 "    if global_rank == 0: torch.save(sd, os.path.join(save_dir, 'pytorch_model.bin'))\n",
    }
    d = read_def(cst.parse_statement(sigs[name]), "", None)
    return dataclasses.replace(d, line=0, notes=(), default=True)


def find_defs(module: cst.Module, rel: str, data: bytes = b"") -> dict:
    """name -> SaveDef for the save functions ``module`` defines at top level (upstream's when missing)."""
    found = {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef) and s.name.value in RENAMES}
    try:
        tree = calls.parse(data)[0] if data else None
    except (SyntaxError, UnicodeDecodeError, LookupError, ValueError):
        tree = None
    nodes = {n.name: n for n in (tree.body if tree else ()) if isinstance(n, ast.FunctionDef)}
    source = calls.Source(calls.parse(data)[1].text) if tree else None
    aliases = folder.module_aliases(module) if found else {}
    out = {}
    for name in RENAMES:
        if name in found:
            fn_ast = nodes.get(name)
            out[name] = read_def(found[name], rel, fn_ast.lineno if fn_ast else None, fn_ast, source, aliases)
        else:
            out[name] = dataclasses.replace(default_def(name), missing=not _binds(module, name))
    return out


def _binds(module: cst.Module, name: str) -> bool:
    """Whether ``module`` binds ``name`` at its top level in some other way than a def: an import (a star
    import may bring it), an assignment, a class."""
    for stmt in module.body:
        small = stmt.body if isinstance(stmt, cst.SimpleStatementLine) else [stmt]
        for node in small:
            if isinstance(node, cst.ImportFrom) and isinstance(node.names, cst.ImportStar):
                return True
            if isinstance(node, (cst.Import, cst.ImportFrom)) and not isinstance(node.names, cst.ImportStar):
                for alias in node.names:
                    bound = alias.asname.name if alias.asname else alias.name
                    if isinstance(bound, cst.Name) and bound.value == name:
                        return True
            if isinstance(node, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
                targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
                if any(isinstance(t, cst.Name) and t.value == name for t in targets):
                    return True
            if isinstance(node, cst.ClassDef) and node.name.value == name:
                return True
            if isinstance(node, (cst.If, cst.Try)) and name in cst.Module(body=[node]).code:
                return True  # defined under a condition: dsfix cannot tell, so it does not refuse
    return False


# ----------------------------------------------------------------------------- generating dsfix's function


def generate(sd: SaveDef, docstring: str, indent: str = "    ") -> str:
    """dsfix's replacement of ``sd`` as source text: the same parameters, the folder computed as the
    original computes it, then one call of the template's core function."""
    new = RENAMES[sd.name]
    args = [next(p.name for p in sd.params if p.kind in ("posonly", "pos"))]
    passed = dict(sd.passed)
    if sd.name == "save_hf_format":
        args.append(passed.pop("tokenizer", "None"))
    args.append(sd.folder)
    taken = {p.name for p in sd.params}
    for key, value in passed.items():
        args.append(f"{key}={value}")
    if sd.drop is not None:  # the fork's own save leaves out other keys than upstream's: so does dsfix's
        args.append(f"drop={sd.drop}")
    if sd.name == "save_zero_three_model" and "config" in sd.writes:  # the fork's ZeRO-3 save writes config.json
        args.append("with_config=True")
    for e in EXTRAS:
        args.append(f"{e}={e}" if e not in taken else f"{e}=None")
    lines = [sd.header(new), f"{indent}{docstring}"]
    lines += [indent + s.replace("\n", "\n" + indent) if "\n" in s else indent + s for s in sd.where]
    lines.append(f"{indent}{CORE[sd.name]}({', '.join(args)})")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- binding a call


def bind(params: tuple, args: list) -> dict | None:
    """param name -> argument text, as ``inspect.Signature.bind`` would bind a call's ``args``
    (patcher.patch.calls.Arg: keyword, star, text).

    None when the call unpacks ``*x``/``**y`` (it binds as it did before, the parameters being the same).
    Raises ValueError naming the parameter when the call cannot bind.
    """
    if any(a.star for a in args):
        return None
    slots = [p for p in params if p.kind in ("posonly", "pos")]
    varpos = next((p for p in params if p.kind == "varpos"), None)
    varkw = next((p for p in params if p.kind == "varkw"), None)
    by_name = {p.name: p for p in params if p.kind in ("pos", "kwonly")}
    bound = {}
    positional = [a for a in args if a.keyword is None]
    for i, a in enumerate(positional):
        if i < len(slots):
            bound[slots[i].name] = a.text
        elif varpos is not None:
            bound.setdefault(varpos.name, []).append(a.text)
        else:
            raise ValueError(f"takes {len(slots)} positional argument{'s' if len(slots) != 1 else ''} but "
                             f"the call passes {len(positional)} (argument {i + 1}, `{a.text}`, has no parameter)")
    for a in args:
        if a.keyword is None:
            continue
        key = a.keyword
        if key in by_name:
            if key in bound:
                raise ValueError(f"parameter {key} gets two values (by position and by keyword)")
            bound[key] = a.text
        elif varkw is not None:
            bound.setdefault(varkw.name, {})[key] = a.text
        else:
            raise ValueError(f"has no parameter {key} (passed by keyword)")
    for p in params:
        if p.kind in ("posonly", "pos", "kwonly") and not p.has_default and p.name not in bound:
            raise ValueError(f"parameter {p.name} gets no value")
    return bound


def params_of(source: str) -> tuple:
    """The parameters of a generated def, parsed back (what the rewritten call binds to)."""
    return _params(cst.parse_statement(source))


__all__ = ["SaveDef", "Param", "find_defs", "generate", "bind", "params_of", "RENAMES", "CORE"]
