"""How a model's graphs reach the cluster: every kernel a dask task of its own, or a training
step compiled into one program per worker and phase.

A :class:`~dask_ipar.model.Sequential` holds one executor: a :class:`GraphExecutor` for its
first graphs, and for each training step the one its ``executor`` setting names
(``"programs"`` or ``"graph"``), made anew whenever the setting changes. Both run the same step graph (same kernels, same
placement, the same floats and bytes); they differ in what the scheduler sees:

* :class:`GraphExecutor`: the graph as it is, each task pinned to its cell (the
  dashboard's task stream shows every layer and phase, dask moves the blocks);
* :class:`ProgramExecutor`: a training step as two tasks per worker
  (:func:`dask_ipar.runtime.compiler.compile_programs`) that push blocks to each other over
  the exchange plugin (:mod:`dask_ipar.runtime.exchange`); graphs that are not training
  steps (inference, gradients, device copies) run as with :class:`GraphExecutor`.

Tasks that nothing requested but that must run (prefetches, programs that only send) have
their futures held for the next four submissions, by then they have run. Stopping a step's
waiting programs (a grid worker left, the model closed) is
:func:`dask_ipar.runtime.exchange.abort_programs`, whatever the executor is now.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from dask_ipar.errors import IparError

__all__ = ["EXECUTORS", "GraphExecutor", "ProgramExecutor", "make_executor"]


class GraphExecutor:
    """Submits step graphs as they are: one pinned dask task per kernel."""

    name = "graph"
    #: whether :meth:`submit`'s ``leave`` keys stay in program results (else: futures)
    leaves_in_programs = False

    def __init__(self, client, uid: str, locate, program_timeout_s: float = 300.0):
        self.client = client
        self.uid = uid
        self.locate = locate
        self.program_timeout_s = program_timeout_s
        #: futures of the last submissions' programs that only send (nothing asked for
        #: depends on them): held, so that dask runs them
        self._orphans: deque = deque(maxlen=4)

    def submit(self, graph, name: str, keys, step=None, first=(), held=None, leave=(),
               ahead=None, sent=None):
        """Submit ``graph``; futures of ``keys``. With ``leave``
        (keys the caller keeps as state): ``(futures of keys, {key: its future})``.
        ``ahead`` and ``sent`` are the programs' (:class:`ProgramExecutor`): nothing is
        pushed here, dask's workers fetch what their tasks read."""
        leave = list(leave)
        futs = self.client.get(graph.to_hlg(name), list(keys) + leave, sync=False)
        n, m = len(keys), len(keys) + len(leave)
        if ahead is not None:
            return futs[:n], dict(zip(leave, futs[n:m])), {}
        return (futs[:n], dict(zip(leave, futs[n:m]))) if leave else futs[:n]

    def clear(self) -> None:
        self._orphans.clear()


class ProgramExecutor(GraphExecutor):
    """Runs training steps (``step`` given) as worker programs; the rest as graphs."""

    name = "programs"
    leaves_in_programs = True

    def __init__(self, client, uid: str, locate, program_timeout_s: float = 300.0):
        from dask_ipar.runtime.exchange import install_exchange

        super().__init__(client, uid, locate, program_timeout_s)
        install_exchange(client)
        #: step templates by signature (:mod:`dask_ipar.runtime.templates`), newest last
        self.templates: OrderedDict = OrderedDict()

    def submit(self, graph, name: str, keys, step=None, first=(), held=None, leave=(),
               ahead=None, sent=None):
        """With ``step``: per worker one program for what ``first`` needs (the forward pass
        and the loss statistics) and one for the rest of the step (the prefetches happen
        inside them); ``leave`` keys stay in their program's result (no task of their own:
        ``(futures of keys, {key: future of the program holding it})``), and blocks
        ``held(key)`` names a program for are taken from that program's result; keys of
        ``ahead`` are pushed for the next step as soon as they exist, existing keys already
        pushed (``sent``) are not sent again
        (:func:`~dask_ipar.runtime.compiler.compile_programs`; with ``ahead``, the workers
        each key went to come third: ``(futures, by key, pushed)``); otherwise as
        :meth:`GraphExecutor.submit`."""
        if step is None:
            return super().submit(graph, name, keys, leave=leave)
        from dask_ipar.runtime.compiler import compile_programs

        hlg, _, orphans, left, pushed = compile_programs(
            graph, list(keys), self.locate, name, f"{self.uid}-s{step}",
            self.program_timeout_s, first, held=held, leave=list(leave), ahead=ahead,
            sent=sent)
        futs, by_key = self.run(hlg, keys, orphans, left)
        if ahead is not None:
            return futs, by_key, pushed
        return (futs, by_key) if leave else futs

    def run(self, hlg, keys, orphans, left):
        """Submit compiled programs: futures of ``keys`` and, per key of ``left`` (key ->
        program holding it), the future of its program; ``orphans`` (programs that only
        send) are held for the next four submissions."""
        holders = sorted(set(left.values()), key=str)
        futs = self.client.get(hlg, list(keys) + list(orphans) + holders, sync=False)
        n, m = len(keys), len(keys) + len(orphans)
        if orphans:
            self._orphans.append(futs[n:m])
        by_key = dict(zip(holders, futs[m:]))
        return futs[:n], {k: by_key[pk] for k, pk in left.items()}


#: The executors by the name of the ``executor`` setting.
EXECUTORS = {"graph": GraphExecutor, "programs": ProgramExecutor}


def make_executor(kind, client, uid: str, locate, program_timeout_s: float):
    """The executor named ``kind`` (``"programs"`` or ``"graph"``) for a model."""
    if kind not in EXECUTORS:
        raise IparError(f"executor is {kind!r}, expected 'graph' or 'programs'.")
    return EXECUTORS[kind](client, uid, locate, program_timeout_s)
