"""Does torch.distributed.destroy_process_group return after NCCL collectives were captured in a
CUDA graph? Plain torch, no permgen.

Each variant is one process holding a one-rank NCCL group (env://, MASTER_ADDR/MASTER_PORT on a free
port): it warms up `dist.all_to_all_single` on a side stream, captures it (and a multiply) in a
`torch.cuda.CUDAGraph`, replays it on new inputs and checks the result, then tears down its own way.
All variants run at once, each bounded by the same deadline; the report has one line per variant:
exited (return code, seconds per stage) or hung (the stage it is stuck in, for how long, and its
Python stack), then, with gdb on PATH, the native frames of the first hang, and a conclusion.

    python3 tests/gpu_graph_teardown_repro.py                 # every variant: under 3 minutes
    python3 tests/gpu_graph_teardown_repro.py --only keep,del --timeout 60

The suspicion it tests (pytorch/pytorch#115388): NCCL's communicator teardown (finalize / destroy,
and abort too) waits until every CUDA graph holding work captured on the communicator is destroyed,
so a graph still alive at destroy_process_group blocks it for good, whatever torch does around it.
"""

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

# name -> (what it does, options). Options: graph (capture at all), replay, splits ("list": explicit
# split sizes, the all-to-all-v path dispatch takes; "even": none), before (what runs before the
# teardown call), end ("destroy": destroy_process_group, "abort": _abort_process_group, "none": no
# call, the interpreter exits with the graph alive), lazy (NCCL communicator created on first use,
# not at init), env (extra environment).
VARIANTS = {
    "eager": ("no graph: the collective run eagerly, then destroy", dict(graph=False)),
    "keep": ("graph kept alive, destroy", dict()),
    "keep_even": ("graph kept alive (even splits), destroy", dict(splits="even")),
    "keep_sync": ("graph kept alive, torch.cuda.synchronize(), destroy", dict(before="sync")),
    "keep_barrier": ("graph kept alive, dist.barrier() + synchronize, destroy", dict(before="barrier")),
    "keep_no_replay": ("graph captured but never replayed, kept alive, destroy", dict(replay=False)),
    "keep_lazy_init": ("graph kept alive, group made without device_id, destroy", dict(lazy=True)),
    "keep_async0": ("graph kept alive, TORCH_NCCL_ASYNC_ERROR_HANDLING=0, destroy",
                    dict(env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})),
    "keep_async1": ("graph kept alive, TORCH_NCCL_ASYNC_ERROR_HANDLING=1, destroy",
                    dict(env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})),
    "keep_no_graph_register": ("graph kept alive, NCCL_GRAPH_REGISTER=0, destroy",
                               dict(env={"NCCL_GRAPH_REGISTER": "0"})),
    "keep_abort": ("graph kept alive, _abort_process_group instead of destroy", dict(end="abort")),
    "keep_no_destroy": ("graph kept alive, no destroy: the interpreter exits", dict(end="none")),
    "thread_reset": ("graph kept alive, destroy; a thread resets the graph 5 s into it", dict(before="thread_reset")),
    "del": ("del graph + gc.collect() + synchronize (outputs kept), destroy", dict(before="del")),
    "del_even": ("del graph + gc.collect() + synchronize (even splits), destroy", dict(before="del", splits="even")),
    "del_nosync": ("del graph, nothing else, destroy", dict(before="del_nosync")),
    "reset": ("graph.reset() + synchronize, destroy", dict(before="reset")),
}

KEPT = []  # graphs of the variants whose graph must outlive main() (interpreter exit)


def child(name):
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for the stack of a hang
    opts = dict(graph=True, replay=True, splits="list", before="keep", end="destroy", lazy=False)
    opts.update(VARIANTS[name][1])
    start = time.perf_counter()

    def stage(what):
        print(f"@stage {what} {time.perf_counter() - start:.3f}", flush=True)

    stage("import")
    import gc
    import threading

    import torch
    import torch.distributed as dist

    stage("init")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", **({} if opts["lazy"] else {"device_id": device}))
    x = torch.randn(256, 1024, device=device)
    splits = ([x.shape[0]], [x.shape[0]]) if opts["splits"] == "list" else (None, None)

    def step():
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, *splits)
        return out * 2

    stage("warmup")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = None
    if opts["graph"]:
        stage("capture")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        if opts["replay"]:
            stage("replay")
            new = torch.randn_like(x)
            x.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, new * 2), "the replayed all-to-all moved the wrong values"
    else:
        stage("eager")
        out = step()
        torch.cuda.synchronize()
        assert torch.equal(out, x * 2)
    stage("teardown")
    before = opts["before"]
    if before == "sync":
        torch.cuda.synchronize()
    elif before == "barrier":
        dist.barrier()
        torch.cuda.synchronize()
    elif before == "del":
        del graph
        gc.collect()
        torch.cuda.synchronize()
    elif before == "del_nosync":
        del graph
    elif before == "reset":
        graph.reset()
        torch.cuda.synchronize()
    elif before == "thread_reset":
        def release(g=graph):
            g.reset()
            stage("released_by_thread")

        threading.Timer(5.0, release).start()
    if opts["end"] == "none":
        KEPT.append(graph)
    stage({"destroy": "destroy", "abort": "abort", "none": "no_destroy"}[opts["end"]])
    if opts["end"] == "destroy":
        dist.destroy_process_group()
    elif opts["end"] == "abort":
        dist.distributed_c10d._abort_process_group()
    stage("exit")  # then the interpreter exits


# -- the parent ------------------------------------------------------------------------------------

def free_ports(n):
    """n distinct free TCP ports (held open together while picked)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def header():
    lines = [f"python {sys.version.split()[0]}"]
    try:
        import torch

        nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        lines.append(f"torch {torch.__version__} cuda {torch.version.cuda} nccl {nccl} "
                     f"gpus {torch.cuda.device_count()}")
    except Exception as e:  # noqa: BLE001 -- report what can be had
        lines.append(f"torch: {e!r}")
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,compute_mode", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        lines.append("gpu " + q.stdout.strip().replace("\n", " | "))
    env = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL_", "CUDA_"))}
    lines.append(f"env {env}")
    return lines


def stages_of(text):
    return [(m.group(1), float(m.group(2))) for m in re.finditer(r"^@stage (\S+) ([\d.]+)$", text, re.M)]


def python_stack(err):
    """The main thread's innermost frames from a faulthandler dump: 'func (file:line) <- ...'."""
    block = err.split("Current thread", 1)
    if len(block) < 2:
        return ""
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block[1].split("\n\n", 1)[0])
    return " <- ".join(f"{fn} ({os.path.basename(f)}:{ln})" for f, ln, fn in frames[:4])


def native_stack(pid, seconds):
    """The threads of pid whose native frames mention NCCL or c10d (gdb), compressed to names."""
    try:
        proc = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 40"], capture_output=True,
                              text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return [f"gdb took over {seconds} s"]
    threads = re.split(r"\n(?=Thread \d+ )", proc.stdout)
    out = []
    for t in threads:
        names = re.findall(r"^#\d+\s+(?:0x[0-9a-f]+ in )?([^\s(]+)", t, re.M)
        if any(re.search(r"nccl|c10d|ProcessGroup", n, re.I) for n in names):
            keep = [n for n in names if re.search(r"nccl|c10d|ProcessGroup|cuda|cu[A-Z]|pthread|poll|sleep", n)]
            out.append(t.split("\n", 1)[0][:60] + ": " + " <- ".join(keep[:10]))
    if not out:
        said = proc.stderr.strip().splitlines()
        out.append("no thread with NCCL frames" + (f" (gdb: {said[-1][:200]})" if said else ""))
    return out[:4]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--only", help="comma-separated variant names (default: all)")
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="seconds from launch until a variant still running counts as hung (default 90)")
    parser.add_argument("--no-gdb", action="store_true", help="skip the native stack of the first hang")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    for line in header():
        print(line, flush=True)
    tmp = tempfile.mkdtemp(prefix="graph_teardown_")
    procs = {}
    launched = time.monotonic()
    for name, port in zip(names, free_ports(len(names))):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_RANK": "0", **VARIANTS[name][1].get("env", {})}
        out, err = open(os.path.join(tmp, f"{name}.out"), "w"), open(os.path.join(tmp, f"{name}.err"), "w")
        procs[name] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", name], stdout=out,
                                       stderr=err, env=env, start_new_session=True)
        out.close()
        err.close()
    ended = {}
    while len(ended) < len(procs) and time.monotonic() - launched < args.timeout:
        for name, p in procs.items():
            if name not in ended and p.poll() is not None:
                ended[name] = time.monotonic() - launched
        time.sleep(0.2)
    hung = [n for n in names if n not in ended]
    for name in hung:
        procs[name].send_signal(signal.SIGUSR1)
    time.sleep(2)
    native = []
    if hung and not args.no_gdb and shutil.which("gdb"):
        first = next((n for n in hung if n.startswith("keep")), hung[0])
        native = [f"native stack of {first} (gdb):"] + ["    " + t for t in native_stack(procs[first].pid, 45)]
    killed = {}
    for name in hung:
        try:
            os.killpg(procs[name].pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        procs[name].wait()
        killed[name] = time.monotonic() - launched
    print(f"\n{len(names)} variants at once, deadline {args.timeout:.0f} s from launch:")
    outcome = {}
    for name in names:
        text = open(os.path.join(tmp, f"{name}.out")).read()
        err = open(os.path.join(tmp, f"{name}.err")).read()
        st = stages_of(text)
        times = " ".join(f"{s} {st[i + 1][1] - t:.2f}" for i, (s, t) in enumerate(st[:-1]))
        last, last_t = st[-1] if st else ("start", 0.0)
        if name in hung:
            outcome[name] = "hung"
            head = f"HUNG in {last} ({killed[name] - last_t:.0f} s there, killed)"
            tail = f" | py: {python_stack(err)}" if python_stack(err) else ""
        else:
            rc = procs[name].returncode
            outcome[name] = "exited" if rc == 0 and last == "exit" else "failed"
            head = f"exited rc={rc} in {ended[name]:.1f} s"
            tail = f" | {last} {ended[name] - last_t:.2f} s to process exit" if st else ""
            if outcome[name] == "failed":
                tail += " | " + (err.strip().splitlines() or ["no stderr"])[-1][:200]
        print(f"{name:24s} {head:40s} | {VARIANTS[name][0]} | stages: {times}{tail}", flush=True)
    for line in native:
        print(line)
    print("\n" + conclusion(outcome))
    shutil.rmtree(tmp, ignore_errors=True)


def conclusion(outcome):
    def all_are(state, *names):
        present = [n for n in names if n in outcome]
        return bool(present) and all(outcome[n] == state for n in present)

    if outcome.get("eager") not in (None, "exited"):
        return "conclusion: even the eager variant did not exit cleanly: the machine's NCCL set-up, not graphs."
    if all_are("hung", "keep", "keep_even") and all_are("exited", "del", "reset"):
        text = ("conclusion: torch/NCCL's, not permgen's: with a graph that captured a collective still alive, "
                "destroy_process_group never returns; reset or delete every such graph first and it returns "
                "(pytorch/pytorch#115388).")
        if outcome.get("thread_reset") == "exited":
            text += " Releasing the graph while destroy waits lets destroy finish: it waits on the graph."
        return text
    if all_are("exited", "keep", "keep_even"):
        return ("conclusion: plain torch exits with the graph alive here: the hang needs something this reproducer "
                "lacks (look at what permgen's capture adds).")
    return "conclusion: mixed; read the lines above."


if __name__ == "__main__":
    main()
