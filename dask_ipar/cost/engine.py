"""What the dask-ipar engine runs, in the cost model's terms: one layer at a time.

The engine (``dask_ipar.Sequential``) runs a CNN's conv layers batch-parallel first
(whole images of each cell's samples), then domain-parallel (row strips over Pr), then
model-parallel (filters over Pr, whole images); each pooling layer keeps the layout of
the layer in front of it (strips when it comes first); then the flatten redistribution
and the dense layers on the grid (Eq. 8). Layouts here: ``"batch"``, ``"domain"``,
``"model"`` for conv and pooling layers, ``"dense"`` for dense layers, and ``"input"``
in front of the first layer.

- :func:`engine_layout`: the layout a layer runs in.
- :func:`engine_refusal`: why the engine refuses a layer in a layout on a grid (the
  checks of ``dask_ipar.nn.shapes.front_layouts``, ``dask_ipar.nn.dense_layout.check_dense_grid``
  and the step's batch checks), or ``""``.
- :func:`engine_layer_phases`: the phases the engine's step sends for one layer, from
  the same functions the run's comm table (``dask_ipar.runtime.meter.predict_step``)
  uses; the planner's engine mode and :func:`dask_ipar.cost.price_assignment` walk a
  network with them.

Pure Python: no dask, no engine import.
"""

from __future__ import annotations

from dask_ipar.cost.conv import (
    domain_layer_phases,
    engine_alltoall_phases,
    engine_model_conv_phases,
)
from dask_ipar.cost.layers import FC, Conv2d, Pool2d
from dask_ipar.cost.machine import Machine
from dask_ipar.cost.model import PhaseCost, batch_layer_phases, dense_layer_phases, redistribute_phase
from dask_ipar.cost.rowpar import dense_form, row_parallel_phases

__all__ = ["ENGINE_ORDER", "engine_layout", "engine_refusal", "engine_layer_phases"]

#: The conv schemes the engine runs, in the order it runs them.
ENGINE_ORDER = ("batch", "domain", "model")


def engine_layout(layer, scheme: str | None, state: str) -> str:
    """The layout the engine runs ``layer`` in after a layer of layout ``state``.

    A conv layer runs in its ``scheme``; a pooling layer in ``state`` (``"domain"`` when
    it comes first, ``state == "input"``); a dense layer in ``"dense"``.
    """
    if isinstance(layer, FC):
        return "dense"
    if isinstance(layer, Conv2d):
        if scheme not in ENGINE_ORDER:
            raise ValueError(f"scheme of {layer.name or 'a conv layer'}: got {scheme!r}; "
                             f"expected one of {', '.join(ENGINE_ORDER)}")
        return scheme
    return "domain" if state == "input" else state


def engine_refusal(layer, layout: str, state: str, pr: int, pc: int, batch: int) -> str:
    """Why the engine refuses to run ``layer`` in ``layout`` (after a layer of layout
    ``state``) on a ``pr x pc`` grid with ``batch`` samples per step; ``""`` when it runs.

    The engine's rules: conv and pooling layers before the dense layers; conv schemes in
    the order batch, domain, model; a model-parallel conv splits whole filters, ungrouped,
    over Pr (at least Pr filters); batch-parallel convs need a sample on every cell
    (``batch >= Pr*Pc``); a layer on strips needs an output row on every grid row
    (``out_h >= Pr``); a dense layer needs an output row per grid row
    (``d_out >= Pr``) and a weight column per grid column (``d_in + bias >= Pc``).
    """
    name = layer.name or type(layer).__name__
    if isinstance(layer, FC):
        if layer.d_out < pr:
            return f"{name} has {layer.d_out} outputs, fewer than Pr={pr}"
        if layer.weight_cols < pc:
            return f"{name} has {layer.weight_cols} weight columns, fewer than Pc={pc}"
        return ""
    if state == "dense":
        return f"{name}: conv and pooling layers come before the dense layers"
    if isinstance(layer, Conv2d):
        if state in ENGINE_ORDER and ENGINE_ORDER.index(layout) < ENGINE_ORDER.index(state):
            return (f"{name} is {layout}-parallel after a {state}-parallel layer (the engine "
                    "runs batch, then domain, then model)")
        if layout == "model" and layer.groups > 1:
            return f"{name}: model-parallel convs are ungrouped (groups={layer.groups})"
        if layout == "model" and layer.out_c < pr:
            return f"{name} has {layer.out_c} filters, fewer than Pr={pr}"
        if layout == "batch" and pr * pc > batch:
            return f"{name}: batch-parallel convs need P={pr * pc} <= batch {batch}"
    if layout == "domain" and layer.out_h < pr:
        return f"{name} has {layer.out_h} output rows on strips, fewer than Pr={pr}"
    return ""


def engine_layer_phases(
    layer, layout: str, state: str, pr: int, pc: int, batch: int, machine: Machine, *,
    name: str | None = None, prev_name: str | None = None, first_layer: bool = False,
    following: tuple | None = None,
) -> list[PhaseCost]:
    """The phases the engine's training step sends for ``layer`` run in ``layout`` after a
    layer (``prev_name``) of layout ``state`` (engine convention, exact bytes).

    - dense layer: the flatten redistribution when a conv or pooling layer is in front
      (:func:`redistribute_phase` of ``d_in``, named ``layer.flatten`` or the layer's name),
      then Eq. 8 (:func:`dense_layer_phases`; no ``dx_reduce`` for the ``first_layer``);
      the network's last layer (``following`` empty: the layers after this one; None, not
      known, prices Eq. 8) after a dense layer where the engine
      runs it row-parallel (:func:`dask_ipar.cost.rowpar.row_parallel_output`) in that form
      (:func:`~dask_ipar.cost.rowpar.row_parallel_phases`), and the dense layer in front
      of it then without its output gather;
    - ``"domain"``: the all-to-all from a batch layout in front
      (:func:`engine_alltoall_phases`), the halo exchanges and, for a conv, the weight
      all-reduce over all P (:func:`domain_layer_phases`);
    - ``"batch"``: a conv's weight all-reduce over all P (:func:`batch_layer_phases`);
      pooling is local;
    - ``"model"``: :func:`engine_model_conv_phases` for a conv; pooling is local on the
      channel blocks (its consumer gathers its output).
    """
    name = name or layer.name
    if isinstance(layer, FC):
        rowpar, gather = dense_form(layer, state == "dense", following, pr, pc, batch)
        if rowpar:
            return row_parallel_phases(layer, pr, pc, batch, machine, name=name)
        out = []
        if state in ENGINE_ORDER:
            out.append(redistribute_phase(layer.d_in, pr, pc, batch, machine,
                                          name=layer.flatten or name))
        return out + dense_layer_phases(layer, pr, pc, batch, machine, first_layer=first_layer,
                                        convention="engine", name=name, gather_output=gather)
    if not isinstance(layer, (Conv2d, Pool2d)):
        raise ValueError(f"layer: got {type(layer).__name__}; expected FC, Conv2d or Pool2d")
    if layout == "model":
        if isinstance(layer, Pool2d):
            return []
        return engine_model_conv_phases(
            name, layer.d_in, layer.weight_cols - int(layer.bias), layer.out_c, layer.bias, pr,
            pc, batch, machine, prev_name=prev_name,
            prev_layout=state if state in ENGINE_ORDER else None)
    if layout == "batch":
        return batch_layer_phases(layer, pr * pc, machine, name=name) if isinstance(layer, Conv2d) else []
    out = []
    if state == "batch":  # samples -> strips, and the gradients back
        channels = layer.in_c if isinstance(layer, Conv2d) else layer.channels
        out = engine_alltoall_phases(name, layer.in_h, channels * layer.in_w, pr, pc, batch, machine)
    return out + domain_layer_phases(layer, pr, pc, batch, machine, convention="engine", name=name,
                                     first_layer=first_layer)
