"""How bench_scale.py measures one method: a child process tree, sampled and guarded, from a cold page cache.

* :func:`run_tree`: wall time, CPU time (the tree's, from the children's rusage), peak anonymous and peak
  file-backed memory of the whole process tree (RssAnon and RssFile of every process, summed, sampled every
  20 ms); past ``limit`` bytes of anonymous memory the tree is killed and the result says at how much, so that a
  method that cannot fit never leaves the kernel's OOM killer to choose a victim among other processes.
* :func:`drop_caches`: sync, then the kernel's page cache dropped (root on Linux); False where not allowed.
* :func:`cold`: one method run so (the cache dropped, then :func:`run_tree`); :func:`dsfix` and :func:`read_once`
  the two kinds of method most cases run.
* :data:`FLOOR`: the disk floor, every fp32 master read once, then the output's bytes written once and fsynced
  (:func:`write_once`).
* :data:`READ`: the safetensors files under one or more folders read once, 16 MiB at a time: what verify's time
  is judged by.
* :data:`WRITE`: :func:`write_once` as a method of its own: a number of bytes written once to a new file and
  fsynced (the file then removed).
* :data:`COMPARE`: two folders compared tensor by tensor, the reference cast to the output's dtype, bit for bit.
"""
import json
import os
import resource
import signal
import subprocess
import sys
import time

import common

GIB = 1024.0 ** 3
RESERVE = 1.5 * GIB

FLOOR = r'''
import glob, os, sys, time
import torch
step, out, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
buf = bytearray(16 << 20)
view = memoryview(buf)
spans = []  # (file, offset, bytes) of each rank's fp32 masters: not the Adam moments written before them
for path in sorted(glob.glob(os.path.join(step, "*_optim_states.pt"))):
    osd = torch.load(path, map_location="meta", weights_only=True)["optimizer_state_dict"]
    for t in osd.get("fp32_flat_groups") or osd.get("single_partition_of_fp32_groups"):
        storage = t.untyped_storage()  # on the meta device: where the bytes are, none read
        spans.append((path, storage._checkpoint_offset, storage.nbytes()))
t = time.perf_counter()
read = 0
for path, offset, size in spans:
    with open(path, "rb", buffering=0) as handle:
        end = offset + size
        while offset < end:
            n = os.preadv(handle.fileno(), [view[:min(len(buf), end - offset)]], offset)
            if not n:
                break
            offset += n
            read += n
t_read = time.perf_counter() - t
sys.path.insert(0, "benchmarks")  # the method runs in the repository's root
import scale_measure
print("%d %.3f %.3f" % (read, t_read, scale_measure.write_once(out, nbytes)))
'''

READ = r'''
import glob, os, sys, time
buf = bytearray(16 << 20)
view = memoryview(buf)
paths = sorted(p for folder in sys.argv[1:] for p in glob.glob(os.path.join(folder, "**", "*.safetensors"),
                                                                recursive=True))
t = time.perf_counter()
read = 0
for path in paths:
    with open(path, "rb", buffering=0) as handle:
        while True:
            n = handle.readinto(view)
            if not n:
                break
            read += n
print("%d %.3f" % (read, time.perf_counter() - t))
'''

WRITE = r'''
import sys
sys.path.insert(0, "benchmarks")  # the method runs in the repository's root
import scale_measure
print("%.3f" % scale_measure.write_once(sys.argv[1], int(sys.argv[2])))
'''

COMPARE = r'''
import json, os, sys, torch
from safetensors import safe_open
out, ref = sys.argv[1], sys.argv[2]
index = os.path.join(ref, "pytorch_model.bin.index.json")
files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["pytorch_model.bin"]
handles = {}
for name in os.listdir(out):
    if name.endswith(".safetensors"):
        h = safe_open(os.path.join(out, name), framework="pt")
        handles.update((k, h) for k in h.keys())
seen, differ = set(), []
for f in files:
    state = torch.load(os.path.join(ref, f), map_location="cpu", mmap=True, weights_only=True)
    for key, value in state.items():
        mine = handles[key].get_tensor(key)
        if mine.shape != value.shape or not torch.equal(mine.view(-1), value.to(mine.dtype).view(-1)):
            differ.append(key)
        seen.add(key)
        del mine
    del state
print(json.dumps({"compared": len(seen), "differ": differ, "only_here": sorted(set(handles) - seen)}))
'''


def _children(pid):
    found = []
    try:
        for tid in os.listdir("/proc/%d/task" % pid):
            with open("/proc/%d/task/%s/children" % (pid, tid)) as handle:
                found += [int(c) for c in handle.read().split()]
    except OSError:
        pass
    return found


def _rss(pid):
    """(RssAnon, RssFile) of one process in bytes; zeros once it is gone."""
    anon = rfile = 0
    try:
        with open("/proc/%d/status" % pid) as handle:
            for line in handle:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith("RssFile:"):
                    rfile = int(line.split()[1]) * 1024
    except OSError:
        pass
    return anon, rfile


def _tree(pid):
    """``pid`` and all its descendants now."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += _children(p)
    return found


def tree_rss(pid):
    """(anonymous, file-backed) bytes of ``pid`` and all its descendants now."""
    anon = rfile = 0
    for p in _tree(pid):
        a, f = _rss(p)
        anon, rfile = anon + a, rfile + f
    return anon, rfile


def _kill_tree(pid, cgroup):
    """SIGKILL to ``pid``'s process group and every descendant (torch.distributed.run starts its ranks in sessions
    of their own), where ``pid`` is given (a live process), and to everything in ``cgroup``."""
    victims = set() if pid is None else set(_tree(pid))
    if cgroup is not None:
        try:
            with open(os.path.join(cgroup, "cgroup.procs")) as handle:
                victims.update(int(p) for p in handle.read().split())
        except OSError:
            pass
    if pid is not None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    for p in victims:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def available():
    """MemAvailable in bytes: what the machine can still give without swapping or killing."""
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def memory_cgroup(limit):
    """A memory cgroup of its own under this process's, limited to ``limit`` bytes (cgroup v1's
    memory.limit_in_bytes, or v2's memory.max): the kernel then stops the tree at the limit however fast it
    allocates, and its OOM killer chooses only among the tree's processes. Its path, or None where none can be
    made (not root, no memory controller): the sampling guard alone then."""
    try:
        with open("/proc/self/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    found = [(h, c, p) for h, c, p in (line.split(":", 2) for line in lines)]
    tries = [("/sys/fs/cgroup/memory" + p, "memory.limit_in_bytes") for _, c, p in found if "memory" in c.split(",")]
    tries += [("/sys/fs/cgroup" + p, "memory.max") for h, c, p in found if h == "0" and not c]
    for base, knob in tries:
        path = os.path.join(base, "dsfix-bench-%d" % os.getpid())
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, knob), "w") as handle:
                handle.write("%d\n" % int(limit))
            return path
        except OSError:
            try:
                os.rmdir(path)
            except OSError:
                pass
    return None


def _oom_kills(cgroup):
    for name in ("memory.oom_control", "memory.events"):
        try:
            with open(os.path.join(cgroup, name)) as handle:
                for line in handle:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except OSError:
            continue
    return 0


def _remove_cgroup(cgroup):
    for _ in range(600):  # a killed tree's processes leave it as they finish exiting (ranks of GBs: seconds)
        try:
            os.rmdir(cgroup)
            return
        except OSError:
            time.sleep(0.1)
    print("[scale] could not remove the memory cgroup %s (processes still in it)" % cgroup, file=sys.stderr)


def run_tree(argv, limit=None, cwd=None, env=None, timeout=None, reserve=RESERVE):
    """Runs ``argv`` (its own session) to its end, or kills its whole tree past ``limit`` anonymous bytes, when
    the machine's available memory falls under ``reserve`` bytes (others' work is not this run's to push out), or
    past ``timeout`` seconds. Returns a dict: wall_s, cpu_s, anon_peak, file_peak (bytes), returncode, killed_at
    (bytes, or None), timed_out, stdout, stderr (its tail)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # COLUMNS: a report's table rows unwrapped, so the work folder's path, scrubbed from what is saved, is whole
    env = dict(os.environ if env is None else env, NO_COLOR="1", TOKENIZERS_PARALLELISM="false", COLUMNS="1000")
    cgroup = memory_cgroup(limit) if limit is not None else None

    def enter():  # in the child, before it runs argv: it and all it starts are held by the cgroup
        if cgroup is not None:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as handle:
                handle.write(str(os.getpid()))

    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=enter)
    out_chunks, err_chunks = [], []
    import threading

    readers = [threading.Thread(target=lambda s=s, b=b: b.append(s.read()), daemon=True)
               for s, b in ((proc.stdout, out_chunks), (proc.stderr, err_chunks))]
    for t in readers:
        t.start()
    anon_peak = file_peak = 0
    killed_at, timed_out = None, False
    while proc.poll() is None:
        anon, rfile = tree_rss(proc.pid)
        anon_peak, file_peak = max(anon_peak, anon), max(file_peak, rfile)
        free = available()
        over = (limit is not None and anon > limit) or (free is not None and free < reserve)
        late = timeout is not None and time.perf_counter() - start > timeout
        if over or late:
            killed_at, timed_out = (anon if over else None), late
            _kill_tree(proc.pid, cgroup)
            proc.wait()
            break
        time.sleep(0.02)
    wall = time.perf_counter() - start
    for t in readers:
        t.join(5)
    if cgroup is not None:
        if _oom_kills(cgroup) and killed_at is None:
            killed_at = limit  # the kernel stopped it at the cgroup's limit
        _kill_tree(None, cgroup)  # whatever it left behind (a rank waiting on a peer the kernel killed)
        _remove_cgroup(cgroup)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "anon_peak": anon_peak, "file_peak": file_peak, "cgroup": cgroup is not None,
            "returncode": proc.returncode, "killed_at": killed_at, "timed_out": timed_out,
            "stdout": "".join(out_chunks), "stderr": "".join(err_chunks)[-3000:]}


def drop_caches():
    """sync, then drop the page cache, dentries and inodes; False where this process may not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def cold(argv, args, note=None):
    """One method from a cold cache (unless ``args.warm``), under the memory guard (``args.limit_gib``,
    ``args.timeout``), a line on stderr when it ends."""
    dropped = False if args.warm else drop_caches()
    load = load_now()
    res = run_tree(argv, limit=args.limit_gib * GIB, cwd=common.REPO_ROOT, timeout=args.timeout)
    res.update(cold=dropped, load=load)
    if note:
        print("[scale]   %s: %.1f s, anon %.0f MiB%s" % (note, res["wall_s"], res["anon_peak"] / common.MIB,
                                                         ", killed" if res["killed_at"] else ""),
              file=sys.stderr, flush=True)
    return res


def json_of(res):
    """The method's stdout as JSON, or None."""
    try:
        return json.loads(res["stdout"])
    except ValueError:
        return None


def dsfix(argv, args, note, keep=()):
    """``python -m patcher ARGV --json`` as a method (:func:`cold`): ok when it exits 0 and its report says so; the
    report's fields named in ``keep`` kept."""
    res = cold(python("-m", "patcher", *argv, "--json"), args, note)
    report = json_of(res) or {}
    res.update({k: report.get(k) for k in keep}, ok=bool(report.get("ok")) and res["returncode"] == 0)
    return res


def read_once(folders, args, note):
    """:data:`READ` of ``folders`` as a method (:func:`cold`): its bytes and seconds."""
    res = cold(python("-c", READ, *folders), args, note)
    read, seconds = res["stdout"].split()
    res.update(read_bytes=int(read), read_s=float(seconds))
    return res


def write_once(path, nbytes):
    """``nbytes`` written once to a new file at ``path``, 16 MiB at a time, and fsynced; the file then removed.
    The seconds it took: the disk's write floor."""
    chunk = memoryview(bytearray(16 << 20))
    begin = time.perf_counter()
    with open(path, "wb", buffering=0) as handle:
        left = nbytes
        while left > 0:
            left -= handle.write(chunk[:min(left, len(chunk))])
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - begin
    os.remove(path)
    return seconds


def python(*args):
    return [sys.executable] + list(args)


def load_now():
    """The 1-minute load average."""
    return os.getloadavg()[0]
