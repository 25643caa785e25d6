"""The fork's own save functions: their parameters, what each one means, and where they save.

dsfix's public functions take the checkout's own parameter list, so every call that bound to
``save_hf_format`` or ``save_zero_three_model`` binds to dsfix's function the same way. What each
parameter means is read from the original definition:

* model: the first positional parameter; tokenizer: a parameter whose name contains "tokenizer";
  rank: ``global_rank`` or ``rank``; ZeRO stage: ``zero_stage`` or ``stage``; ``args``: the options.
* where: the folder the original writes to (its first ``os.makedirs``, else the folder joined with a
  file name or given to ``save_pretrained``). The statements that compute it are copied verbatim, so
  dsfix saves exactly where the original did, ``sub_folder`` and any other parameter included.
* any other parameter: accepted and unused when the original never reads it (a note says so), carried
  when it only feeds the folder, and refused when the original reads it for anything else, since dsfix
  cannot tell what it changes.

``bind`` checks a call against a parameter list the way ``inspect.Signature.bind`` would.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from dataclasses import dataclass

import libcst as cst

from patcher.patch import calls
from patcher.errors import DsfixError
from patcher.patch.names import CORE, RENAMES
from patcher.patch.template import dotted

EXTRAS = ("max_shard_size", "strategy")  # dsfix's own keyword-only options
RANK_NAMES = ("global_rank", "rank")
STAGE_NAMES = ("zero_stage", "stage")
_FILE_NAME = re.compile(r"(?i)(weights?|config|model|safetensors|bin|json|file)")
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
    writes: frozenset = frozenset({"weights", "config", "tokenizer"})  # what the original saves
    drops_lora: bool = True  # the original leaves LoRA weights out ("lora" in a key test)

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


class _OwnBody(cst.CSTVisitor):
    """Visits a function's own code: nested functions and classes are other scopes, left out."""

    def visit_FunctionDef(self, node):
        return False

    def visit_ClassDef(self, node):
        return False


class _Reads(_OwnBody):
    """Names read in a node (attribute names and keyword names left out)."""

    def __init__(self):
        self.names = []

    def visit_Name(self, node):
        self.names.append(node.value)

    def visit_Attribute(self, node):
        node.value.visit(self)
        return False

    def visit_Arg(self, node):
        node.value.visit(self)
        return False


def reads(node) -> set:
    v = _Reads()
    node.visit(v)
    return set(v.names)


class _Calls(_OwnBody):
    def __init__(self):
        self.calls = []

    def visit_Call(self, node):
        self.calls.append(node)

    def visit_Lambda(self, node):
        return False


def _calls(node) -> list:
    v = _Calls()
    node.visit(v)
    return v.calls


def _dotted(node) -> str:
    try:
        return dotted(node)
    except TypeError:
        return ""


def _folder_call(stmts) -> tuple:
    """(statement index, folder expression) of the first call that says where the function writes."""
    for rule in ("makedirs", "join", "save_pretrained"):
        for i, stmt in enumerate(stmts):
            for call in _calls(stmt):
                name = _dotted(call.func)
                pos = [a for a in call.args if a.keyword is None and not a.star]
                if rule == "makedirs" and name.split(".")[-1] in ("makedirs", "mkdir") and pos:
                    return i, pos[0].value
                if rule == "join" and name in ("os.path.join", "path.join", "join") and len(pos) >= 2:
                    last = pos[-1].value
                    named = isinstance(last, cst.Name) and _FILE_NAME.search(last.value)
                    literal = isinstance(last, cst.SimpleString) and "." in last.value
                    if (named or literal) and len(pos) == 2:
                        return i, pos[0].value
                    if named or literal:
                        head = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) if j == len(pos) - 2 else a
                                for j, a in enumerate(pos[:-1])]
                        return i, call.with_changes(args=head)
                if rule == "save_pretrained" and name.endswith(".save_pretrained") and pos:
                    return i, pos[0].value
    return None, None


_BINDING = {cst.AssignTarget: "target", cst.AugAssign: "target", cst.AnnAssign: "target", cst.For: "target",
            cst.AsName: "name", cst.NamedExpr: "target"}  # node type -> the field holding what it binds


def _assigned(stmt) -> set:
    """Names a statement binds (targets of any kind), to tell whether slicing may stop at it."""
    out = set()

    class V(cst.CSTVisitor):
        def on_visit(self, node):
            if isinstance(node, cst.FunctionDef):
                out.add(node.name.value)
                return False
            field = _BINDING.get(type(node))
            if field is not None:
                out.update(reads(getattr(node, field)))
            return True

    stmt.visit(V())
    return out


def _simple_assign(stmt):
    """(name, value) for a line ``name = value``, else None."""
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
            return small.targets[0].target.value, small.value
    return None


def _body(fn: cst.FunctionDef) -> list:
    body = list(fn.body.body) if isinstance(fn.body, cst.IndentedBlock) else list(fn.body.body)
    if body and isinstance(body[0], cst.SimpleStatementLine) and isinstance(body[0].body[0], cst.Expr) \
            and isinstance(body[0].body[0].value, (cst.SimpleString, cst.ConcatenatedString)):
        body = body[1:]  # the docstring
    return body


def _where(fn: cst.FunctionDef, rel: str, line: int) -> tuple:
    """(statements copied, folder expression text, indices of the statements copied)."""
    body = _body(fn)
    at, folder = _folder_call(body)
    if folder is None:
        raise DsfixError(f"cannot tell which folder {fn.name.value} writes to (no os.makedirs, no folder joined "
                         "with a file name, no save_pretrained); dsfix will not guess", path=rel, line=line)
    needed = reads(folder)
    taken = []
    for i in range(at - 1, -1, -1):
        stmt = body[i]
        hit = _assigned(stmt) & needed
        if not hit:
            continue
        simple = _simple_assign(stmt)
        if simple is None or simple[0] not in needed:
            raise DsfixError(
                f"{fn.name.value} computes its folder ({', '.join(sorted(hit))}) in a statement dsfix cannot copy "
                f"safely (`{code(stmt).strip()[:60]}`); dsfix will not guess where it saves", path=rel, line=line)
        taken.append(i)
        needed = (needed - {simple[0]}) | reads(simple[1])
    taken.reverse()
    stmts = tuple(code(body[i].with_changes(leading_lines=[])).strip("\n") for i in taken)
    return stmts, code(folder), set(taken), at


def _writes(fn: ast.FunctionDef) -> tuple:
    """(what the function saves: a subset of {"weights", "config", "tokenizer"}, whether it drops LoRA keys),
    read with ast (a libcst pass over the body costs ten times more)."""
    out, lora = set(), False
    for node in ast.walk(fn):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "lora" in node.value.lower():
            lora = True
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
    return frozenset(out), lora


def read_def(fn: cst.FunctionDef, rel: str, line: int, fn_ast: ast.FunctionDef = None) -> SaveDef:
    """What dsfix's replacement of ``fn`` must take, pass and copy; refuses what it cannot carry over."""
    name = fn.name.value
    params = _params(fn)
    positional = [p for p in params if p.kind in ("posonly", "pos")]
    if not positional:
        raise DsfixError(f"{name} takes no positional model parameter", path=rel, line=line)
    where, folder, taken, _ = _where(fn, rel, line)
    writes, drops_lora = _writes(fn_ast or ast.parse(code(fn)).body[0])
    if name == "save_hf_format" and "weights" not in writes:
        raise DsfixError(f"{name} saves no weights (no torch.save, save_file or save_pretrained of the model in "
                         "it): there is nothing in it for dsfix to turn into safetensors", path=rel, line=line)
    body = _body(fn)
    where_reads = set().union(*(reads(body[i]) for i in taken)) if taken else set()
    folder_node = cst.parse_expression(folder)
    where_reads |= reads(folder_node)
    other_reads = set().union(*(reads(s) for i, s in enumerate(body) if i not in taken)) if body else set()
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
    return SaveDef(name, params, line, where, folder, tuple(passed), tuple(notes), writes=writes,
                   drops_lora=drops_lora)


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
    d = read_def(cst.parse_statement(sigs[name]), "", 0)
    return dataclasses.replace(d, line=0, notes=(), default=True)


def find_defs(module: cst.Module, rel: str, data: bytes = b"") -> dict:
    """name -> SaveDef for the save functions ``module`` defines at top level (upstream's when missing)."""
    found = {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef) and s.name.value in RENAMES}
    try:
        tree = calls.parse(data)[0] if data else None
    except (SyntaxError, UnicodeDecodeError, LookupError, ValueError):
        tree = None
    nodes = {n.name: n for n in (tree.body if tree else ()) if isinstance(n, ast.FunctionDef)}
    out = {}
    for name in RENAMES:
        if name in found:
            fn_ast = nodes.get(name)
            out[name] = read_def(found[name], rel, fn_ast.lineno if fn_ast else None, fn_ast)
        else:
            out[name] = default_def(name)
    return out


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
    if not sd.drops_lora:  # the fork's own save keeps LoRA weights: so does dsfix's
        args.append("drop=lambda name: False")
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
