"""An emulated multi-host dask cluster on one machine: network namespaces, a bridge, tc tbf.

    sudo python benchmarks/netcluster.py --workers 4 --rate 1gbit [--quick] [--json out.json]
    sudo python benchmarks/netcluster.py --cleanup        # remove leftovers of a killed run

Layout (all of it private to this run; nothing is added to the host's own namespace):

* a "hub" namespace holding a Linux bridge;
* one namespace for the scheduler, one per worker and one for the client, each with a
  veth pair: ``eth0`` (10.213.0.x/24) inside the node, the peer on the bridge in the hub;
* ``tc qdisc ... tbf rate RATE`` on both ends of every worker and scheduler veth, i.e. each
  direction of each link is limited to RATE (the client's link is left unlimited by
  default: it only carries the batches, which a real cluster would read locally);
* no default route, no forwarding, no link to the host: traffic cannot leave the bridge.

``emulated_cluster(n_workers, rate)`` is a context manager that builds this, starts
``dask scheduler`` and ``dask worker`` processes inside the namespaces, moves the calling
thread into the client namespace (so a ``distributed.Client`` made inside the ``with``
reaches the scheduler) and yields the scheduler address. On exit, on error, on Ctrl-C, on
SIGTERM and at interpreter exit it kills its processes and deletes its namespaces (the
bridge and veths go with them).

The CLI checks the link rate (a 64 MiB worker-to-worker transfer) and the programs' 4-byte
hop, runs ``dask-ipar calibrate`` on the cluster, then runs the benchmark models on every
grid of the workers beside each grid's simulated step (``rank_grids``: the calibrated
machine with the link check's bandwidth and hop; a CNN's conv schemes on each grid are the
simulation's pick) and the alpha-beta communication alone, and compares the measured
ranking of grids with the predicted one.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

#: probes of the 4-byte hop a sweep takes of the programs and of gloo each (medians compared)
HOP_PROBES = 3
PREFIX = "dipn"
SUBNET = "10.213.0"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _sh(*args, check=True):
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _setns(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns({path}): {os.strerror(e)}")
    finally:
        os.close(fd)


def list_namespaces(prefix=PREFIX):
    r = _sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines()
            if line.split() and line.split()[0].startswith(prefix + "-")]


def cleanup_all(prefix=PREFIX):
    """Delete every namespace this tool ever made (after killing processes inside them)."""
    for ns in list_namespaces(prefix):
        pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _sh("ip", "netns", "del", ns, check=False)
    return list_namespaces(prefix)


class _Cluster:
    def __init__(self, n_workers, rate, client_rate, threads, port, tag, peers=0,
                 reuse_memory=True):
        self.n, self.rate, self.client_rate = n_workers, rate, client_rate
        self.peers = peers
        self.peer_ns: list = []  # (namespace, address) of each PyTorch rank's host
        self.threads, self.port = threads, port
        self.reuse_memory = reuse_memory
        self.tag = tag
        self.ns = []
        self.procs = []
        self.logs = []
        self.orig_ns_fd = None
        self.done = False

    def nsname(self, role):
        return f"{PREFIX}-{self.tag}-{role}"

    # -------------------------------------------------------------- network
    def _add_node(self, role, host, rate):
        ns = self.nsname(role)
        hub = self.nsname("hub")
        _sh("ip", "netns", "add", ns)
        self.ns.append(ns)
        a, b = f"v{self.tag}{role}a"[:15], f"v{self.tag}{role}b"[:15]
        # create the pair inside the hub namespace, then move one end into the node
        _sh("ip", "-n", hub, "link", "add", a, "type", "veth", "peer", "name", b)
        _sh("ip", "-n", hub, "link", "set", b, "netns", ns)
        _sh("ip", "-n", ns, "link", "set", b, "name", "eth0")
        _sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{host}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", hub, "link", "set", a, "master", "br0")
        _sh("ip", "-n", hub, "link", "set", a, "up")
        if rate:
            tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf)
            _sh("ip", "netns", "exec", hub, "tc", "qdisc", "add", "dev", a, "root", *tbf)
        return ns, f"{SUBNET}.{host}"

    def _spawn(self, ns, args, env_extra, name):
        env = dict(os.environ)
        env.update(env_extra)
        logf = open(os.path.join("/tmp", f"{self.nsname(name)}.log"), "w")
        self.logs.append(logf)
        p = subprocess.Popen(["ip", "netns", "exec", ns, *args], stdout=logf, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
        self.procs.append(p)
        return p

    def start(self):
        hub = self.nsname("hub")
        _sh("ip", "netns", "add", hub)
        self.ns.append(hub)
        _sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", hub, "link", "set", "br0", "up")
        s_ns, s_ip = self._add_node("s", 1, self.rate)
        c_ns, _ = self._add_node("c", 2, self.client_rate)
        import common as C

        # the workers' malloc settings are those of dask-ipar's own clusters
        # (``REUSE_MEMORY_ENV``, as every loopback benchmark's), or dask's default
        env = {**C.blas_env(self.threads)} if self.reuse_memory else {
            "OMP_NUM_THREADS": str(self.threads), "OPENBLAS_NUM_THREADS": str(self.threads),
            "MKL_NUM_THREADS": str(self.threads), "MALLOC_TRIM_THRESHOLD_": "65536"}
        # and their dask settings those of the clusters dask-ipar starts (event-loop
        # housekeeping, the profiler's interval, the scheduler's worker TTL; before
        # session 39 dask's defaults: a 10 ms profiler made busy workers' steps 1.1x long)
        from dask_ipar.runtime.worker_env import config_environ

        env.update(config_environ(_dask_config()))
        env.update({
            "DASK_DISTRIBUTED__SCHEDULER__ACTIVE_MEMORY_MANAGER__START": "False",
            "DASK_OPTIMIZATION__FUSE__ACTIVE": "False",
            "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE),
                                           os.environ.get("PYTHONPATH", "")])})
        self.address = f"tcp://{s_ip}:{self.port}"
        dask_bin = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
        self._spawn(s_ns, [*dask_bin, "--host", s_ip, "--port", str(self.port),
                           "--dashboard-address", f"{s_ip}:0"], env, "s")
        for k in range(self.n):
            w_ns, w_ip = self._add_node(f"w{k}", 10 + k, self.rate)
            self._spawn(w_ns, [sys.executable, "-m", "distributed.cli.dask_worker", self.address,
                               "--host", w_ip, "--nthreads", "1", "--no-nanny",
                               "--name", f"w{k}", "--memory-limit", "0",
                               "--no-dashboard"], env, f"w{k}")
        for k in range(self.peers):  # hosts of their own for the PyTorch ranks, same links
            self.peer_ns.append(self._add_node(f"p{k}", 50 + k, self.rate))
        # the calling thread joins the client namespace
        self.orig_ns_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        _setns(f"/run/netns/{c_ns}")
        return self.address

    def stop(self):
        if self.done:
            return
        self.done = True
        if self.orig_ns_fd is not None:
            with contextlib.suppress(OSError):
                if _libc.setns(self.orig_ns_fd, CLONE_NEWNET) != 0:
                    print("netcluster: could not return to the original network namespace",
                          file=sys.stderr)
            os.close(self.orig_ns_fd)
            self.orig_ns_fd = None
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in reversed(self.ns):
            for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _sh("ip", "netns", "del", ns, check=False)
        for f in self.logs:
            f.close()


def run_peer(cl, mode: str, mesh: str, spec: dict, batch: int, steps: int, threads: int,
             check: bool = False, timeout_s: float = 900.0) -> dict:
    """Run the PyTorch peer ``mode`` (:mod:`peers`) on ``mesh`` with one rank in each peer
    namespace of the cluster ``cl`` (rank k on host p<k>); rank 0's JSON result."""
    pr, pc = (int(v) for v in mesh.split("x"))
    world = pr * pc
    if world > len(cl.peer_ns):
        raise ValueError(f"{mesh} needs {world} peer hosts; the cluster has {len(cl.peer_ns)}")
    master = f"{cl.peer_ns[0][1]}:{29500 + int(time.time()) % 400}"
    t = str(threads)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS=t, MKL_NUM_THREADS=t,
               OPENBLAS_NUM_THREADS=t, PYTHONWARNINGS="ignore")
    args = [sys.executable, os.path.join(HERE, "peers.py"), "--mode", mode, "--mesh", mesh,
            "--world", str(world), "--master", master, "--spec", json.dumps(spec),
            "--batch", str(batch), "--steps", str(steps),
            "--threads", t] + (["--check"] if check else [])
    procs = []
    for r in range(world):
        ns = cl.peer_ns[r][0]
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *args, "--rank", str(r)],
                                      stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True, env=env,
                                      start_new_session=True))
    try:
        out, err = procs[0].communicate(timeout=timeout_s)
    finally:
        for p in procs[1:]:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    lines = [ln for ln in (out or "").splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"peer {mode} {mesh} printed no result: {(err or '')[-2000:]}")
    return json.loads(lines[-1])


@contextlib.contextmanager
def emulated_cluster(n_workers: int, rate: str = "1gbit", *, client_rate: str | None = None,
                     threads: int = 1, port: int = 8786, wait_s: float = 60.0,
                     peers: int = 0, handle: list | None = None, reuse_memory: bool = True):
    """Build the emulated cluster, yield the scheduler address, tear everything down.

    While inside the ``with``, the calling thread (and threads it starts, e.g. the
    dask Client's event loop) lives in the client namespace. ``peers`` adds that many hosts
    for PyTorch ranks on links of the same rate (:func:`run_peer`); ``handle`` (a list)
    gets the cluster object appended, for :func:`run_peer`. ``reuse_memory``: the workers get
    the malloc settings of dask-ipar's own clusters (``REUSE_MEMORY_ENV``), else dask's default.
    """
    if os.geteuid() != 0:
        raise PermissionError("emulated_cluster needs root (network namespaces, tc)")
    cl = _Cluster(n_workers, rate, client_rate, threads, port, f"{os.getpid() % 100000}",
                  peers, reuse_memory)
    if handle is not None:
        handle.append(cl)
    atexit.register(cl.stop)
    old_term = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    if _in_main_thread():
        signal.signal(signal.SIGTERM, on_term)
    try:
        addr = cl.start()
        _wait_for(addr, n_workers, wait_s)
        yield addr
    finally:
        cl.stop()
        atexit.unregister(cl.stop)
        if _in_main_thread():
            signal.signal(signal.SIGTERM, old_term)


def _in_main_thread():
    import threading
    return threading.current_thread() is threading.main_thread()


def _wait_for(addr, n, wait_s):
    from distributed import Client

    deadline = time.monotonic() + wait_s
    while True:
        try:
            with Client(addr, timeout=5) as c:
                c.wait_for_workers(n, timeout=max(1, deadline - time.monotonic()))
                return
        except (OSError, TimeoutError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"emulated cluster: {n} workers did not connect to {addr} in {wait_s} s")
            time.sleep(0.5)


# ---------------------------------------------------------------- benchmark
def parse_rate_Bps(rate: str) -> float:
    r = rate.lower().strip()
    for suf, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1)):
        if r.endswith(suf):
            return float(r[: -len(suf)]) * mult / 8
    raise ValueError(f"rate {rate!r}: use e.g. 1gbit or 500mbit")


#: the PyTorch peers and the meshes each runs on, for P processes (see peers.py)
def peer_runs(p: int, modes) -> list[tuple[str, str]]:
    runs = []
    for mode in modes:
        if mode in ("ddp", "fsdp"):
            runs.append((mode, f"1x{p}"))
        elif mode == "tp":
            import common as C

            runs += [("tp", f"{pr}x{pc}") for pr, pc in C.grids_of(p) if pr > 1]
    return runs


def _peer(cl, mode, mesh, cfg, steps, threads, check=False):
    print(f"{cfg.label} torch {mode} {mesh} ...", flush=True)
    r = run_peer(cl, mode, mesh, cfg.spec(), cfg.batch, steps, threads, check=check)
    print(f"   {r['step_s']:.3f} s", flush=True)
    return r


def link_check(client, rate) -> dict:
    """The link between the first two workers: a 64 MiB block's time, less a 4-byte one's
    (its rate), and a 4-byte hop between worker programs (direct, and over dask's comms);
    ``rate`` the nominal one (None: no limit, loopback)."""
    import common as C
    from dask_ipar.runtime.calibrate import program_hop
    from dask_ipar.runtime.exchange import DIRECT_MAX_BYTES

    ws = sorted(client.scheduler_info()["workers"])
    big, small = C.transfer_time(client, ws[0], ws[1], 64 * 2**20)
    bw = 64 * 2**20 / max(big - small, 1e-9)
    hop = program_hop(client, ws[0], ws[1])
    via_dask = program_hop(client, ws[0], ws[1], direct=False)
    print(f"link check: 64 MiB in {big:.3f} s -> {bw * 8 / 1e9:.3f} Gbit/s "
          f"(nominal {rate or 'none'}); 4-byte dask task transfer {small * 1e3:.1f} ms, "
          f"4-byte program hop {hop * 1e3:.2f} ms (over dask's comms "
          f"{via_dask * 1e3:.2f} ms)", flush=True)
    return {"t_64MiB_s": big, "t_4B_s": small, "bandwidth_Bps": bw,
            "nominal_Bps": parse_rate_Bps(rate) if rate else None, "program_hop_4B_s": hop,
            "program_hop_dask_s": via_dask, "direct_max_bytes": (None if DIRECT_MAX_BYTES == float("inf")
                                                      else DIRECT_MAX_BYTES),
            "wire_reader": "program"}


def _dask_config() -> dict:
    """The dask settings the emulated cluster's processes get beyond dask's defaults:
    those of the clusters dask-ipar starts (recorded with each run since session 39), and
    this process's ``ipar.matmul`` (``DASK_IPAR__MATMUL``; since session 40)."""
    import dask

    import dask_ipar.config  # noqa: F401 (registers the ipar defaults)
    from dask_ipar.runtime.worker_env import QUIET_LOOP_CONFIG, SCHEDULER_CONFIG

    return {**QUIET_LOOP_CONFIG, **SCHEDULER_CONFIG,
            "ipar.matmul": dask.config.get("ipar.matmul", "auto")}


def step_machine(client, link, log=True, **effort):
    """The step-time model's machine: ``dask-ipar calibrate`` on this cluster (``effort``:
    fields of its :class:`~dask_ipar.runtime.calibrate.Effort` to replace), its link
    figures from :func:`link_check` (64 MiB and the programs' 4-byte hop)."""
    from dask_ipar.runtime.calibrate import calibrate

    cal = calibrate(client, log=(lambda m: print(f"calibrate: {m}", flush=True))
                    if log else None, **effort)
    return cal.replace(bandwidth_Bps=link["bandwidth_Bps"], message_s=link["program_hop_4B_s"])


def run_benchmark(n_workers, rate, quick, steps, client_rate=None, threads=1, only=None,
                  executor="graph", peers=(), configs=None, pairs=0, passes=1,
                  data="client", steps_per_program=1, hop_probes=HOP_PROBES):
    """Time dask-ipar on every grid of the emulated cluster, and with ``peers`` (modes of
    peers.py) the PyTorch peers on the same links, side by side in one run: per MLP, DDP
    first, dask-ipar's grids, FSDP and tensor + data parallel, DDP again (so drift shows).
    ``pairs``: then that many more rounds of the planner's grid and the best peer back to
    back; the planner-grid-vs-peer ratios use the medians over all their runs (this
    machine's speed moves by a third within minutes: one run of each is a coin toss where
    they are close). ``passes``: the grids timed that many times, every pass after the
    first in the other order, after the peers and before DDP's second run; a grid's step is the
    median over its passes' two-step windows (:func:`common.pipelined_step`), each pass's
    own in ``passes_s`` (their spread: the run's drift and noise). ``data``: where
    dask-ipar's batches come from (``common.DATA_PATHS``). ``steps_per_program``: dask-ipar's
    steps a submission, or ``"auto"`` (each grid's as ``fit`` and ``dask-ipar train`` pick
    them on the calibrated machine and these cores: the grids ranked and timed so).
    ``hop_probes``: with ``peers``, the programs' 4-byte hop and gloo's each probed that many
    times, alternated (:func:`hop_rounds`); the hop target and the model's ``message_s``
    take their medians."""
    import numpy as np  # noqa: F401
    import warnings
    from distributed import Client

    import common as C
    from dask_ipar.cost import Machine, mlp, plan
    from dask_ipar.cost import price_assignment
    from dask_ipar.nn.planning import cost_specs
    from dask_ipar.runtime.gridrank import rank_grids

    warnings.filterwarnings("ignore")
    out = {"workers": n_workers, "rate": rate, "client_rate": client_rate, "threads": threads,
           "steps": steps, "quick": quick, "grids": {}, "targets": [], "executor": executor,
           "peers": list(peers), "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "dask_config": _dask_config(), "data": data, "steps_per_program": steps_per_program}
    handle: list = []
    with emulated_cluster(n_workers, rate, client_rate=client_rate, threads=threads,
                          peers=n_workers if peers else 0, handle=handle) as addr:
        cl = handle[0]
        with Client(addr) as client:
            out["link"] = link = link_check(client, rate)
            bw, small, hop = link["bandwidth_Bps"], link["t_4B_s"], link["program_hop_4B_s"]
            if peers:
                pp = gloo_pingpong(cl, n_workers, threads)
                out["peer_link"] = pp
                print(f"peer link check (gloo): 64 MiB in {pp['t_64MiB_s']:.3f} s -> "
                      f"{pp['bandwidth_Bps'] * 8 / 1e9:.3f} Gbit/s; 4-byte hop "
                      f"{pp['hop_4B_s'] * 1e3:.2f} ms", flush=True)
                # one sample of each moves by up to 2x on 2 shared cores: more rounds,
                # the two alternated, and the target on the medians
                hops, gloo = hop_rounds(client, cl, n_workers, threads, hop_probes - 1)
                link["program_hops_s"], pp["hops_s"] = [hop, *hops], [pp["hop_4B_s"], *gloo]
                hop = link["program_hop_4B_s"] = statistics.median(link["program_hops_s"])
                ghop = pp["hop_4B_s"] = statistics.median(pp["hops_s"])
                ratio = hop / ghop
                out["targets"].append({
                    "target": f"emulated {rate}, {n_workers} hosts: 4-byte hop, worker "
                              f"programs / gloo ({hop * 1e3:.2f} / {ghop * 1e3:.2f} ms"
                              + (f", medians of {hop_probes} probes each)" if hop_probes > 1
                                 else ")"),
                    "limit": "<= 2.0", "value": ratio, "ok": ratio <= 2.0})
            machine = Machine(alpha_s=small, bandwidth_Bps=bw, compute_s_per_iter=0.0)
            sim_machine = step_machine(client, link)
            out["machine"] = dataclasses.asdict(sim_machine)
            cores = os.cpu_count()
            for cfg in configs or C.configs(quick):
                if only and cfg.key not in only:
                    continue
                shape = cfg.image if isinstance(cfg, C.CNNConfig) else (cfg.widths[0],)
                # the grids (and a CNN's conv schemes) ranked by the simulated step
                ranked = rank_grids(cfg.layers(), shape, n_workers, cfg.batch, sim_machine,
                                    cores=cores, executor=executor,
                                    steps_per_program=steps_per_program)
                sim = {str(c.grid): c for c in ranked}
                best_g = str(ranked[0].grid)
                schemes = {g: c.layers for g, c in sim.items()} \
                    if isinstance(cfg, C.CNNConfig) else {}
                if isinstance(cfg, C.CNNConfig):  # the alpha-beta communication alone
                    pred = {}
                    for g, c in sim.items():
                        assign = {f"conv{k}": lay.parallel for k, lay in enumerate(c.layers)
                                  if type(lay).__name__ == "Conv2d"}
                        pred[g] = price_assignment(cost_specs(c.layers, cfg.image), assign,
                                                   c.grid.pr, c.grid.pc, cfg.batch, machine)
                else:
                    pl = plan(mlp(list(cfg.widths)), n_workers, cfg.batch, machine)
                    pred = {f"{g.pr}x{g.pc}": g for g in pl.grids if g.feasible}
                runs = peer_runs(n_workers, peers)
                got = {}
                if ("ddp", f"1x{n_workers}") in runs:
                    got["ddp"] = [_peer(cl, "ddp", f"1x{n_workers}", cfg, steps, threads,
                                        check=True)]
                by = {g: {"pred_comm_s": pred[g].comm_s if g in pred else None,
                          "pred_step_s": sim[g].seconds if g in sim else None,
                          "steps_per_program": sim[g].steps_per_program if g in sim else 1,
                          "passes_s": [], "steps_s": []}
                      for g in (f"{pr}x{pc}" for pr, pc in C.grids_of(n_workers))}

                def time_grids(order):  # one pass over the grids
                    for g in order:
                        print(f"{cfg.label} {g} ...", flush=True)
                        r = C.time_dask_grid(client, cfg, g, steps, warmup=1, profile=False,
                                             executor=executor, layers=schemes.get(g),
                                             data=data,
                                             steps_per_program=by[g]["steps_per_program"])
                        by[g]["passes_s"].append(r["step_s"])
                        by[g]["steps_s"].append(r["steps_s"])
                        print(f"   {r['step_s']:.3f} s (predicted {by[g]['pred_step_s']:.3f} "
                              f"s, alpha-beta comm {by[g]['pred_comm_s']:.3f} s)", flush=True)

                time_grids(list(by))
                for mode, mesh in runs:
                    if mode != "ddp":
                        got[f"{mode} {mesh}"] = [_peer(cl, mode, mesh, cfg, steps, threads,
                                                       check=True)]
                for _ in range(passes - 1):  # again, the other way round: drift shows
                    time_grids(list(by)[::-1])
                for r in by.values():  # every pass's two-step windows
                    r["step_s"] = C.pipelined_step(*r["steps_s"])
                if "ddp" in got:
                    got["ddp"].append(_peer(cl, "ddp", f"1x{n_workers}", cfg, steps, threads))
                om = sorted(by, key=lambda g: by[g]["step_s"])
                op = sorted(by, key=lambda g: by[g]["pred_step_s"])
                best = best_g
                batch_g = f"1x{n_workers}"
                sp = by[batch_g]["step_s"] / by[best]["step_s"]
                entry = {
                    "label": cfg.label, "widths": cfg.widths, "batch": cfg.batch, "by_grid": by,
                    "order_measured": om, "order_predicted": op, "planner_grid": best,
                    "speedup_vs_batch": sp, "ranking_matches": om == op,
                    "describe": cfg.describe(),
                }
                if schemes:
                    entry["conv_schemes"] = {g: [getattr(lay, "parallel", None) for lay in ls
                                                 if type(lay).__name__ == "Conv2d"]
                                             for g, ls in schemes.items()}
                out["grids"][cfg.key] = entry
                if got:
                    peer_s = {k: statistics.median([r["step_s"] for r in v])
                              for k, v in got.items()}
                    best_peer = min(peer_s, key=peer_s.get)
                    entry["peers"] = {k: {"step_s": peer_s[k],
                                          "runs_s": [r["step_s"] for r in v],
                                          "steps_s": [t for r in v for t in r["steps_s"]],
                                          "loss0": v[0]["loss0"],
                                          "loss0_single": v[0].get("loss0_single")}
                                      for k, v in got.items()}
                    entry["best_peer"] = best_peer
                    ours = [by[best]["step_s"]]
                    if pairs:
                        mode, _, mesh = best_peer.partition(" ")
                        mesh = mesh or f"1x{n_workers}"
                        for _ in range(pairs):
                            print(f"{cfg.label} pair: {best} and {best_peer} ...", flush=True)
                            ours.append(C.time_dask_grid(
                                client, cfg, best, steps, warmup=1, profile=False,
                                executor=executor, layers=schemes.get(best),
                                data=data,
                                steps_per_program=by[best]["steps_per_program"])["step_s"])
                            got[best_peer].append(_peer(cl, mode, mesh, cfg, steps, threads))
                        entry["pairs"] = {"rounds": pairs, "dask_s": ours,
                                          "peer_s": [r["step_s"] for r in got[best_peer]]}
                        peer_s[best_peer] = statistics.median(entry["pairs"]["peer_s"])
                        entry["peers"][best_peer]["step_s"] = peer_s[best_peer]
                        entry["peers"][best_peer]["runs_s"] = entry["pairs"]["peer_s"]
                        entry["peers"][best_peer]["steps_s"] = [
                            t for r in got[best_peer] for t in r["steps_s"]]
                    entry["planner_step_s"] = statistics.median(ours)
                    entry["ratio_vs_best_peer"] = entry["planner_step_s"] / peer_s[best_peer]
                    out["targets"].append({
                        "target": f"emulated {rate}, {n_workers} hosts, {cfg.label}: "
                                  f"dask-ipar's planner grid ({best}) / best peer "
                                  f"({best_peer})", "limit": "<= 1.00",
                        "value": entry["ratio_vs_best_peer"],
                        "ok": entry["ratio_vs_best_peer"] <= 1.0})
                    if "ddp" in peer_s:
                        entry["ratio_vs_ddp"] = entry["planner_step_s"] / peer_s["ddp"]
                        at_1g4 = n_workers == 4 and parse_rate_Bps(rate) == 1e9 / 8
                        limit = {"weight": 0.10, "cnn": 0.50}.get(cfg.key) if at_1g4 else None
                        if limit is not None:
                            out["targets"].append({
                                "target": f"emulated {rate}, {n_workers} hosts, {cfg.label}: "
                                          f"dask-ipar's planner grid ({best}) / DDP",
                                "limit": f"<= {limit:.2f}", "value": entry["ratio_vs_ddp"],
                                "ok": entry["ratio_vs_ddp"] <= limit})
                if cfg.key == "weight":
                    out["targets"].append({
                        "target": f"emulated {rate}, {n_workers} workers: pure batch step / planner's "
                                  f"grid ({best}) step, weight-dominated", "limit": ">= 1.50",
                        "value": sp, "ok": sp >= 1.5})
                out["targets"].append({
                    "target": f"emulated {rate}, {n_workers} workers: measured ranking of grids = "
                              f"predicted ({cfg.label}: measured {' < '.join(om)}, predicted "
                              f"{' < '.join(op)})", "limit": "equal", "value": None,
                    "ok": om == op})
                near = by[op[0]]["step_s"] / by[om[0]]["step_s"]
                out["targets"].append({
                    "target": f"emulated {rate}, {n_workers} workers, {cfg.label}: measured step "
                              f"of the predicted best grid ({op[0]}) / the measured best "
                              f"({om[0]})", "limit": "<= 1.05", "value": near,
                    "ok": near <= 1.05})
                for g in by:
                    ratio = by[g]["pred_step_s"] / by[g]["step_s"]
                    out["targets"].append({
                        "target": f"emulated {rate}, {n_workers} workers, {cfg.label} {g}: "
                                  "predicted / measured step", "limit": "0.85-1.15",
                        "value": ratio, "ok": 0.85 <= ratio <= 1.15})
    return out


def gloo_pingpong(cl, n_workers, threads) -> dict:
    """gloo's link check between ranks 0 and 1 of the ``n_workers`` PyTorch hosts
    (``peers.py pingpong``: the 4-byte hop, half the median of 50 round trips, and a 64 MiB
    transfer)."""
    return run_peer(cl, "pingpong", f"1x{n_workers}", {"kind": "mlp", "widths": [1, 1]},
                    1, 1, threads)


def hop_rounds(client, cl, n_workers, threads, rounds):
    """``rounds`` more probes of the 4-byte hop, the worker programs'
    (``linkprobe.program_hop``: half the median round trip of 50) then gloo's
    (``peers.py pingpong``: the same over 50), alternated: ``(programs, gloo)`` lists."""
    from dask_ipar.runtime.calibrate import program_hop

    ws = sorted(client.scheduler_info()["workers"])
    progs, gloo = [], []
    for _ in range(rounds):
        progs.append(program_hop(client, ws[0], ws[1]))
        gloo.append(gloo_pingpong(cl, n_workers, threads)["hop_4B_s"])
        print(f"4-byte hop: programs {progs[-1] * 1e3:.3f} ms, gloo {gloo[-1] * 1e3:.3f} ms",
              flush=True)
    return progs, gloo


def check_links(n_workers, rate, client_rate, threads, gloo: bool, rounds: int = 3) -> dict:
    """The link checks alone: a 64 MiB transfer, then ``rounds`` times, back to back, the
    programs' 4-byte hop over their direct links and over dask's comms and (``gloo``)
    PyTorch's ping-pong on the same links. Returns what it measured (seconds)."""
    import common as C
    from distributed import Client

    from dask_ipar.runtime.calibrate import program_hop

    handle: list = []
    out = {"workers": n_workers, "rate": rate, "program_hops_s": [], "dask_hops_s": [],
           "gloo_hops_s": [], "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with emulated_cluster(n_workers, rate, client_rate=client_rate, threads=threads,
                          peers=n_workers if gloo else 0, handle=handle) as addr:
        with Client(addr) as client:
            ws = sorted(client.scheduler_info()["workers"])
            big, small = C.transfer_time(client, ws[0], ws[1], 64 * 2**20)
            out.update(t_64MiB_s=big, t_4B_s=small, bandwidth_Bps=64 * 2**20 / (big - small))
            print(f"64 MiB in {big:.3f} s: {64 * 2**20 / (big - small) * 8 / 1e9:.3f} Gbit/s; "
                  f"4 B dask task transfer in {small * 1e3:.1f} ms", flush=True)
            for r in range(rounds):
                hop = program_hop(client, ws[0], ws[1])
                via = program_hop(client, ws[0], ws[1], direct=False)
                out["program_hops_s"].append(hop)
                out["dask_hops_s"].append(via)
                print(f"4-byte program hop: direct links {hop * 1e3:.3f} ms, dask comms "
                      f"{via * 1e3:.3f} ms", flush=True)
                if gloo:
                    pp = gloo_pingpong(handle[0], n_workers, threads)
                    out["gloo_hops_s"].append(pp["hop_4B_s"])
                    print(f"gloo: 4-byte hop {pp['hop_4B_s'] * 1e3:.3f} ms, 64 MiB "
                          f"{pp['bandwidth_Bps'] * 8 / 1e9:.3f} Gbit/s", flush=True)
    print("namespaces left:", list_namespaces())
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--client-rate", default=None, help="also limit the client's link")
    ap.add_argument("--threads", type=int, default=None, help="BLAS threads per worker")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=None, help="comma list of MLPs: compute,weight")
    ap.add_argument("--json", default=None)
    ap.add_argument("--executor", choices=["graph", "programs"], default="graph",
                    help="Sequential.executor of the timed steps")
    ap.add_argument("--peers", default="",
                    help="comma list of PyTorch peers run on the same links: ddp,fsdp,tp "
                         "(needs torch)")
    ap.add_argument("--check-only", action="store_true",
                    help="only build the cluster and check the links (with --peers: gloo's too)")
    ap.add_argument("--cleanup", action="store_true", help="delete leftover namespaces and exit")
    a = ap.parse_args(argv)
    if a.cleanup:
        left = cleanup_all()
        print("left:", left)
        return 0 if not left else 1
    threads = a.threads or max(1, (os.cpu_count() or 1) // a.workers)
    steps = a.steps or (2 if a.quick else 3)
    if a.check_only:
        check_links(a.workers, a.rate, a.client_rate, threads, bool(a.peers))
        return 0
    peers = [m for m in a.peers.split(",") if m]
    bad = [m for m in peers if m not in ("ddp", "fsdp", "tp")]
    if bad:
        ap.error(f"--peers {a.peers}: unknown {', '.join(bad)}; use ddp, fsdp, tp")
    out = run_benchmark(a.workers, a.rate, a.quick, steps, a.client_rate, threads,
                        a.only.split(",") if a.only else None, a.executor, peers)
    print("namespaces left:", list_namespaces())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    for t in out["targets"]:
        print(f"  {t['target']}: {t['value'] if t['value'] is None else round(t['value'], 2)} "
              f"({t['limit']}) -> {'PASS' if t['ok'] else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
