"""The device check's setup stage: what the stages' Python lacks, installed from pinned wheels (or the index)
into folders of the work folder, and dsfix laid out as its wheel lays it out where it is not installed."""
from __future__ import annotations

import os
import shutil
import sys
import time

from device_base import REPO_ROOT, STAGE_TIMEOUT_S, Log

# What a GPU machine's Python may lack, pinned: the wheels device_wheels.sh fetches (``--requirements main``),
# installed for every stage. DeepSpeed ships only an sdist: device_wheels.sh builds its wheel (DS_BUILD_OPS=0).
MAIN_REQUIREMENTS = (
    "libcst==1.9.0", "deepspeed==0.19.8", "hjson==3.1.0", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "annotated-types==0.8.0", "typing-inspection==0.4.5", "typing-extensions==4.16.0", "einops==0.8.2",
)
# What upstream's step 1 needs besides (``--requirements upstream``): transformers before 5 with the tokenizers and
# huggingface_hub it takes, and datasets with its own; installed for the upstream runs alone.
UPSTREAM_REQUIREMENTS = (
    "transformers==4.57.6", "tokenizers==0.22.2", "huggingface-hub==0.36.2", "datasets==4.4.1", "dill==0.4.0",
    "multiprocess==0.70.18", "fsspec==2025.10.0", "xxhash==3.6.0", "pandas==2.3.3", "python-dateutil==2.9.0.post0",
    "pytz==2025.2", "tzdata==2025.2", "six==1.17.0", "requests==2.32.5", "urllib3==2.5.0", "idna==3.11",
    "certifi==2025.10.5", "charset-normalizer==3.4.4", "httpx==0.28.1", "httpcore==1.0.9", "h11==0.16.0",
    "anyio==4.11.0", "sniffio==1.3.1",
)
MAIN_MODULES = ("libcst", "typer", "rich", "torch", "safetensors", "transformers", "deepspeed")
UPSTREAM_MODULES = ("transformers", "datasets", "deepspeed")
# What a GPU machine's Python has and datasets needs: installed from the index where it lacks them too.
UPSTREAM_PRESENT = ("pyarrow==21.0.0",)


def has_pip(log):
    code, _ = log.run([sys.executable, "-m", "pip", "--version"], dict(os.environ), 60)
    return code == 0


def unpack_wheels(files, site, log):
    """What ``pip install --no-index --no-deps --target SITE`` does with these wheels, for a Python without pip:
    each unzipped into SITE, its .data/purelib and .data/platlib moved up beside it (scripts are not needed:
    everything runs as ``python -m``). 0, or 1 when a wheel cannot be read."""
    import zipfile

    for path in files:
        try:
            with zipfile.ZipFile(path) as wheel:
                wheel.extractall(site)
        except (OSError, zipfile.BadZipFile) as e:
            log.write("cannot unpack %s: %s" % (path, e))
            return 1
    for name in os.listdir(site):
        if name.endswith(".data"):
            for sub in ("purelib", "platlib"):
                folder = os.path.join(site, name, sub)
                if os.path.isdir(folder):
                    for item in os.listdir(folder):
                        shutil.move(os.path.join(folder, item), os.path.join(site, item))
            shutil.rmtree(os.path.join(site, name))
    log.write("unpacked %d wheels into %s (no pip)" % (len(files), site))
    return 0


# pyproject.toml's [tool.setuptools.package-dir]: where an installed dsfix finds what the tree keeps at its top
PACKAGE_DIRS = {"patcher.templates": "templates", "patcher._fixtures": "fixtures"}


def lay_out_dsfix(site):
    """dsfix from this working tree, laid out in ``site`` as its wheel lays it out (``patcher/``, with
    ``templates/`` as ``patcher/templates`` and ``fixtures/`` as ``patcher/_fixtures``): run from a clone that was
    never installed, ``patcher.templates`` (the save module, which verify, convert and smoke import) is missing."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(os.path.join(REPO_ROOT, "patcher"), os.path.join(site, "patcher"), ignore=ignore)
    for package, folder in PACKAGE_DIRS.items():
        shutil.copytree(os.path.join(REPO_ROOT, folder), os.path.join(site, *package.split(".")), ignore=ignore)


def stage_setup(check):
    """What is missing, installed (from --wheels, else the index) into folders of the work folder that the stages
    put first on their path; then the versions, and whether the device asked for is there."""
    started = time.time()
    log = Log(os.path.join(check.out, "setup.log"))
    ok, notes = True, []
    code, versions = check.child(log, "versions", check.args.device, *MAIN_MODULES)
    plans = [(check.site, "main", MAIN_REQUIREMENTS, [m for m in MAIN_MODULES if not versions.get(m)])]
    if check.args.upstream:
        plans.append(_upstream_plan(check, log))
    for site, sub, requirements, lacking in plans:
        ok &= _install(check, log, site, sub, requirements, lacking, notes)
        if sub == "main" and lacking:
            code, versions = check.child(log, "versions", check.args.device, *MAIN_MODULES)
    _, found = check.child(log, "modules", "patcher.templates.dsfix_safetensors")
    if not found.get("patcher.templates.dsfix_safetensors"):
        lay_out_dsfix(check.dsfix_site)
        _, found = check.child(log, "modules", "patcher.templates.dsfix_safetensors")
        ok &= bool(found.get("patcher.templates.dsfix_safetensors"))
        notes.append("dsfix: laid out from the working tree (not installed here)%s"
                     % ("" if ok else ", and still not importable"))
    missing = [m for m in MAIN_MODULES if not versions.get(m)]
    if missing:
        ok = False
        notes.append("still not importable: %s" % ", ".join(missing))
    if check.args.upstream:
        ok &= _upstream_importable(check, log, notes)
    if code != 0 or not versions.get("device_ok"):
        ok = False
        notes.append(versions.get("device_problem") or "the versions could not be read (exit %s)" % code)
    check.facts.update((k, v) for k, v in versions.items() if k not in ("typer", "rich"))
    check.row("setup", ok, "; ".join(notes), started)
    return versions


def _upstream_plan(check, log):
    """(site, "upstream", requirements, what upstream's Python lacks): transformers before 5, datasets, pyarrow."""
    _, found = check.child(log, "modules", *UPSTREAM_MODULES, "pyarrow", upstream=True)
    lacking = [m for m in UPSTREAM_MODULES if not found.get(m)]
    if (found.get("transformers") or "5").split(".")[0] != "4":
        lacking.append("transformers<5")
    extra = UPSTREAM_PRESENT if not found.get("pyarrow") else ()
    return check.upstream_site, "upstream", UPSTREAM_REQUIREMENTS + extra, lacking


def _install(check, log, site, sub, requirements, lacking, notes):
    """``lacking`` installed into ``site`` from the wheels' ``sub`` folder (unpacked where this Python has no pip),
    else from the index; what was done appended to ``notes``. Whether it worked (nothing to do: True)."""
    os.makedirs(site, exist_ok=True)
    if not lacking:
        notes.append("%s: nothing to install" % sub)
        return True
    if check.args.wheels:
        folder = os.path.join(check.args.wheels, sub)
        files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".whl"))
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", site, *files]
    else:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", site, *requirements]
    env = dict(os.environ, DS_BUILD_OPS="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    if check.args.wheels and not has_pip(log):
        pcode = unpack_wheels(files, site, log)
    else:
        pcode, _ = log.run(cmd, env, STAGE_TIMEOUT_S["setup"])
    outcome = "installed" if pcode == 0 else "install failed, exit %s" % pcode
    notes.append("%s: %s from %s (lacked %s)" % (sub, outcome, "the wheels" if check.args.wheels else "the index",
                                                 ", ".join(lacking)))
    return pcode == 0


def _upstream_importable(check, log, notes):
    """Whether upstream's packages import in its Python (the facts name their versions); if not, step 1 falls back
    to dsfix's trainer."""
    _, found = check.child(log, "modules", *UPSTREAM_MODULES, upstream=True)
    check.facts["upstream's transformers"] = found.get("transformers")
    check.facts["datasets"] = found.get("datasets")
    if all(found.get(m) for m in UPSTREAM_MODULES):
        return True
    check.upstream_ok = False
    notes.append("upstream's packages not all importable (%s): step 1 falls back to dsfix's trainer"
                 % ", ".join(m for m in UPSTREAM_MODULES if not found.get(m)))
    return False
