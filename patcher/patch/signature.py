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

from patcher.errors import DsfixError, Refused
from patcher.patch import folder, imports, keyfilter, safe, slicer
from patcher.patch import source as src
from patcher.patch.names import MODULE_FUNCTIONS, RENAMES

EXTRAS = ("strategy", "max_shard_size")  # dsfix's own keyword-only options, after the fork's parameters
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
    line: int | None  # the def's line in utils.py (None: read from text alone)
    where: tuple = ()  # the statements (source text) that compute the folder, copied into dsfix's function
    folder: str = "output_dir"  # the expression for the folder, after those statements
    passed: tuple = ()  # (core keyword, expression) pairs besides model and folder
    notes: tuple = ()
    default: bool = False  # True: the template's own (upstream's) definition
    missing: bool = False  # True: the checkout's utils.py binds no such name at all (a use of it fails today)
    writes: frozenset = frozenset({"weights", "config", "tokenizer"})  # what the original saves
    drop: str | None = None  # dsfix's drop= for the keys the original leaves out (None: upstream's "lora" rule)

    def header(self, new_name: str, defaults: dict | None = None, width: int = 100) -> str:
        """``def NEW(<the fork's parameters>, *, strategy=..., max_shard_size=None):``, the extras' default
        values from ``defaults`` (None where not given)."""
        defaults = defaults or {}
        taken = {p.name for p in self.params}
        parts, star = [], False
        for i, p in enumerate(self.params):
            if p.kind in ("varpos", "kwonly") and not star:
                star = True
                if p.kind == "kwonly":
                    parts.append("*")
            if p.kind == "varkw":
                extras = [f"{e}={defaults.get(e, 'None')}" for e in EXTRAS if e not in taken]
                if extras and not star:
                    parts.append("*")
                parts += extras
                taken.update(EXTRAS)
            parts.append(p.text)
            if p.kind == "posonly" and (i + 1 == len(self.params) or self.params[i + 1].kind != "posonly"):
                parts.append("/")
        extras = [f"{e}={defaults.get(e, 'None')}" for e in EXTRAS if e not in taken]
        if extras and not star:
            parts.append("*")
        parts += extras
        return _wrapped(f"def {new_name}(", parts, "):", width)


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
    return slicer.reads(node)


def _body(fn: cst.FunctionDef) -> list:
    body = list(fn.body.body) if isinstance(fn.body, cst.IndentedBlock) else list(fn.body.body)
    if body and isinstance(body[0], cst.SimpleStatementLine) and isinstance(body[0].body[0], cst.Expr) \
            and isinstance(body[0].body[0].value, (cst.SimpleString, cst.ConcatenatedString)):
        body = body[1:]  # the docstring
    return body


def _writes(fn: ast.FunctionDef) -> frozenset:
    """What the function saves: a subset of {"weights", "config", "tokenizer"}, read with ast (a libcst pass
    over the body costs ten times more)."""
    return frozenset().union(*(safe.written(n) for n in ast.walk(fn) if isinstance(n, ast.Call)))


def read_def(fn: cst.FunctionDef, rel: str, line: int | None, fn_ast: ast.FunctionDef | None = None,
             source: src.Source | None = None, aliases: dict | None = None) -> SaveDef:
    """What dsfix's replacement of ``fn`` must take, pass and copy; refuses what it cannot carry over.
    ``fn_ast``/``source``: the same function parsed by ast and its file's text (source.Source), for line
    numbers; ``aliases``: the module's top-level imports (imports.module_aliases)."""
    name = fn.name.value
    params = _params(fn)
    positional = [p for p in params if p.kind in ("posonly", "pos")]
    if not positional:
        raise DsfixError(f"{name} takes no positional model parameter", path=rel, line=line)
    if fn_ast is None or source is None:
        text = code(fn.with_changes(leading_lines=[], decorators=[]))
        fn_ast, source, line = _ast_def(ast.parse(text).body[0]), src.Source(text), line if line else None
    names = {p.name for p in params}
    body = _body(fn)
    where = folder.read_folder(fn, body, names, aliases if aliases is not None else {"os": "os"},
                               folder.Lines(fn, line), rel)
    writes = _writes(fn_ast)
    if name == "save_hf_format" and "weights" not in writes:
        raise DsfixError(f"{name} saves no weights (no torch.save, save_file or save_pretrained of the model in "
                         "it): there is nothing in it for dsfix to turn into safetensors", path=rel, line=line)
    keys = _read_keys(name, fn_ast, source, names, rel)
    other_reads = set().union(*(slicer.reads(s, where.carried) for s in body)) if body else set()
    other_reads -= keys.params  # read by the key test, which dsfix's save carries
    passed, notes = _passed(name, params, positional[0].name, set(where.reads), other_reads, rel, line)
    _check_rank(name, fn, dict(passed), rel, line)
    return SaveDef(name, params, line, where.statements, where.expression, tuple(passed), tuple(notes),
                   writes=writes, drop=keys.argument())


def _read_keys(name: str, fn_ast: ast.FunctionDef, source, names: set, rel: str) -> keyfilter.KeyFilter:
    try:
        return keyfilter.read_filter(fn_ast, source, names)
    except Refused as e:
        raise DsfixError(f"{name} {e.message}; dsfix leaves out only keys it can test by name as the fork does "
                         "(in, ==, startswith, endswith, and/or/not): rewrite that test so", path=rel,
                         line=e.line) from None


def _role(p: Param, where_reads: set) -> str:
    """What a parameter is to the save: read from its name, or from its feeding the folder."""
    if "tokenizer" in p.name:
        return "tokenizer"
    if p.name in RANK_NAMES:
        return "rank"
    if p.name in STAGE_NAMES:
        return "stage"
    if p.name == "args":
        return "args"
    return "where" if p.name in where_reads else "unknown"


PASSED_AS = {"tokenizer": "tokenizer", "rank": "global_rank", "stage": "zero_stage"}  # role -> the module's keyword


def _passed(name: str, params: tuple, model: str, where_reads: set, other_reads: set, rel: str, line) -> tuple:
    """([(the save module's keyword, parameter)], notes): what dsfix's wrapper passes on, and the parameters it
    accepts and leaves unused; refuses a parameter that changes what the original does in a way it cannot tell."""
    passed, notes = [], []
    unused = f"{name}'s parameter {{}} is accepted and unused: the original never reads it"
    for p in params:
        if p.name == model:
            continue
        role, read_elsewhere = _role(p, where_reads), p.name in other_reads
        if role in PASSED_AS and not read_elsewhere and p.name not in where_reads:
            notes.append(unused.format(p.name))
        elif role in PASSED_AS and (role != "stage" or name == "save_zero_three_model"):
            passed.append((PASSED_AS[role], p.name))
        elif role == "unknown" and read_elsewhere:
            raise DsfixError(f"{name}'s parameter {p.name} changes what the original does (it is read outside the "
                             "folder computation), and dsfix cannot tell how; it refuses rather than save something "
                             "else", path=rel, line=line)
        elif role == "unknown" and p.kind not in ("varpos", "varkw"):
            notes.append(unused.format(p.name))
    return passed, notes


def _check_rank(name: str, fn: cst.FunctionDef, passed: dict, rel: str, line) -> None:
    """dsfix must know which rank writes: refuse a save that gathers ZeRO-3 itself, or a ZeRO-3 save, without
    a rank parameter it reads."""
    if "global_rank" in passed:
        return
    if name == "save_hf_format" and ("GatheredParameters" in code(fn) or "gather_16bit" in code(fn)):
        raise DsfixError(f"{name} gathers ZeRO-3 parameters itself but takes no rank parameter, so dsfix cannot "
                         "tell which rank writes", path=rel, line=line)
    if name == "save_zero_three_model":
        raise DsfixError(f"{name} takes no global_rank (or rank) parameter that it reads; dsfix needs it to tell "
                         "which rank writes", path=rel, line=line)


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
                                 "    if global_rank == 0: "
                                 "torch.save(sd, os.path.join(save_dir, 'pytorch_model.bin'))\n",
    }
    d = read_def(_cst_def(cst.parse_statement(sigs[name])), "", None)
    return dataclasses.replace(d, line=0, notes=(), default=True)


def find_defs(data: bytes, rel: str) -> dict:
    """name -> SaveDef for the save functions a utils.py defines at top level (upstream's when it lacks one).
    Python finds them; libcst parses each function's own text only."""
    tree, decoded = src.parse_script(data, rel)
    text = src.Source(decoded.text)
    found = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in RENAMES}
    aliases = imports.module_aliases(tree) if found else {}
    out = {}
    for name in RENAMES:
        fn_ast = found.get(name)
        if fn_ast is not None:
            out[name] = read_def(function_node(text, fn_ast), rel, fn_ast.lineno, fn_ast, text, aliases)
        else:
            out[name] = dataclasses.replace(default_def(name), missing=not imports.binds(tree, name, text.segment))
    return out


def function_node(text: src.Source, fn_ast: ast.FunctionDef) -> cst.FunctionDef:
    """libcst's node of a top-level function, parsed from its own lines (decorators included)."""
    first = min([fn_ast.lineno, *(d.lineno for d in fn_ast.decorator_list)])
    return _cst_def(cst.parse_module("".join(text.lines[first - 1:fn_ast.end_lineno])).body[0])


def _cst_def(node: cst.CSTNode) -> cst.FunctionDef:
    """``node``, parsed from the text of a def (libcst)."""
    if not isinstance(node, cst.FunctionDef):
        raise ValueError(f"not a function: {type(node).__name__}")
    return node


def _ast_def(node: ast.AST) -> ast.FunctionDef:
    """``node``, parsed from the text of a def (ast)."""
    if not isinstance(node, ast.FunctionDef):
        raise ValueError(f"not a function: {type(node).__name__}")
    return node


# ----------------------------------------------------------------------------- generating dsfix's function


def generate(sd: SaveDef, docstring: str, strategy: str, indent: str = "    ", width: int = 100) -> str:
    """dsfix's wrapper of ``sd`` as source text: the same parameters (then ``strategy``, as chosen at apply,
    and ``max_shard_size``), the folder computed as the original computes it, then one call of the save
    module's function."""
    args = [next(p.name for p in sd.params if p.kind in ("posonly", "pos"))]
    passed = dict(sd.passed)
    if sd.name == "save_hf_format":
        args.append(passed.pop("tokenizer", "None"))
    args.append(sd.folder)
    args += [f"{key}={value}" for key, value in passed.items()]
    if sd.drop is not None:  # the fork's own save leaves out other keys than upstream's: so does dsfix's
        args.append(f"drop={sd.drop}")
    if sd.name == "save_zero_three_model" and "config" in sd.writes:  # the fork's ZeRO-3 save writes config.json
        args.append("with_config=True")
    taken = {p.name for p in sd.params}
    chosen = {"strategy": f'"{strategy}"', "max_shard_size": "None"}
    args += [f"{e}={e}" if e not in taken else f"{e}={chosen[e]}" for e in EXTRAS]
    lines = [sd.header(RENAMES[sd.name], chosen), f"{indent}{docstring}"]
    lines += [indent + s.replace("\n", "\n" + indent) if "\n" in s else indent + s for s in sd.where]
    lines.append(_wrapped(f"{MODULE_FUNCTIONS[sd.name]}(", args, ")", width, indent, indent))
    return "\n".join(lines) + "\n"


def _wrapped(opening: str, parts: list, closing: str, width: int, indent: str = "", hang: str = "        ") -> str:
    """``opening`` + the comma-separated ``parts`` + ``closing`` on one line, or, where that would pass
    ``width``, the parts on the lines after the opening, indented by ``hang`` more (PEP 8's hanging indent:
    two steps for a def's parameters, so that they stand apart from its body; one for a call's arguments)."""
    one = indent + opening + ", ".join(parts) + closing
    if len(one) <= width:
        return one
    pad = indent + hang
    lines, line = [indent + opening], pad
    for i, part in enumerate(parts):
        piece = part + ("," if i < len(parts) - 1 else closing)
        if line != pad and len(line) + 1 + len(piece) > width:
            lines.append(line)
            line = pad
        line += piece if line == pad else " " + piece
    return "\n".join(lines + [line])


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
    return _params(_cst_def(cst.parse_statement(source)))


def check_binding(sd: SaveDef, call) -> None:
    """A call (calls.SaveCall) must bind to dsfix's function, each argument to the parameter of the same name
    (and so the same meaning) that it reaches in the checkout's own function."""
    new = RENAMES[sd.name]
    ours = params_of(sd.header(new) + "\n    pass\n")
    try:
        before = bind(sd.params, call.args)
    except ValueError as e:
        raise DsfixError(f"{call.how}(...) does not bind to the checkout's own {sd.name}: it {e}; it would raise "
                         "TypeError already, and dsfix will not rewrite it", line=call.line) from None
    try:
        after = bind(ours, call.args)
    except ValueError as e:  # pragma: no cover - the parameters are copied, so this is a dsfix bug
        raise DsfixError(f"{call.how}(...) would not bind to {new}: it {e}", line=call.line) from None
    if before != after:  # pragma: no cover - likewise
        raise DsfixError(f"{call.how}(...) would pass its arguments to other parameters of {new}", line=call.line)


def check_passable(sd: SaveDef, use) -> None:
    """A use that is not a call (calls.Use: the function stored or passed on) is called later with arguments
    dsfix cannot see: it may refer to dsfix's function only when that takes exactly the fork's parameters."""
    names = {p.name for p in sd.params}
    if any(p.kind == "varkw" for p in sd.params) and not all(e in names for e in EXTRAS):
        raise DsfixError(f"{use.how} is used as a value (stored or passed on), and dsfix's {RENAMES[sd.name]} "
                         f"takes keywords ({', '.join(EXTRAS)}) that the fork's **{sd.params[-1].name} "
                         "would have taken; call it directly instead", line=use.line)


__all__ = ["SaveDef", "Param", "find_defs", "generate", "bind", "params_of", "check_binding", "check_passable"]
