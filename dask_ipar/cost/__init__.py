"""Analytic alpha-beta cost model and grid planner (Gholami et al., SPAA 2018).

Pure Python: importing this package never imports dask, so planning is
instant and needs no cluster.

The engine's per-layer, per-phase predictions (engine convention, default):

>>> from dask_ipar.cost import FC, Machine, dense_layer_phases
>>> phases = dense_layer_phases(FC(784, 100), 2, 3, 64, Machine(), first_layer=True)
>>> [(p.phase, p.total_bytes) for p in phases]
[('fwd_gather', 25600), ('dw_reduce', 628000), ('w_gather', 628000)]
"""

from dask_ipar.cost.collectives import (
    ZERO_COST,
    CommCost,
    allgather_cost,
    allreduce_cost,
    alltoall_cost,
    log2_ceil,
    point_to_point_cost,
    reduce_scatter_cost,
)
from dask_ipar.cost.layers import FC, Conv2d, LayerSpec, Pool2d, as_layer_spec
from dask_ipar.cost.machine import LOOPBACK_MACHINE, PAPER_MACHINE, Machine, load_machine, parse_bandwidth, parse_bytes, save_machine
from dask_ipar.cost.model import (
    CONVENTIONS,
    PHASE_BUCKET,
    MemoryBreakdown,
    PhaseCost,
    batch_layer_phases,
    dense_layer_phases,
    layer_memory_bytes,
    network_phases,
    redistribute_phase,
    grad_norm_phase,
)
from dask_ipar.cost.conv import (
    batch_model_crossover,
    conv_model_phases,
    domain_layer_phases,
    engine_halo_phases,
    window_halo_phases,
    halo_phases,
    exchange_phase,
    engine_alltoall_phases,
    engine_model_conv_phases,
)
from dask_ipar.cost.networks import NETWORKS, alexnet, count_params, from_units, get_network, mlp, resnet50, vgg16
from dask_ipar.cost.simulate import (SimResult, SimTask, fair_rates, simulate_programs,
                                     simulate_step)
from dask_ipar.cost.planner import (MODES, GridPlan, PlanResult, evaluate_grid, factorizations, network_flops, plan,
                                    price_assignment)
from dask_ipar.cost.engine import ENGINE_ORDER, engine_layer_phases, engine_layout, engine_refusal
from dask_ipar.cost.rowpar import (ROW_PARALLEL_MIN_WORDS, dense_form, row_parallel_output,
                                   row_parallel_phases, row_parallel_words)

__all__ = [
    # step-time simulation of the engine's task graph
    "SimTask",
    "SimResult",
    "simulate_step",
    "simulate_programs",
    "fair_rates",
    # machine
    "Machine",
    "PAPER_MACHINE",
    "LOOPBACK_MACHINE",
    "parse_bytes",
    "parse_bandwidth",
    "load_machine",
    "save_machine",
    # collectives
    "CommCost",
    "ZERO_COST",
    "log2_ceil",
    "allgather_cost",
    "reduce_scatter_cost",
    "allreduce_cost",
    "alltoall_cost",
    "point_to_point_cost",
    # layers and networks
    "FC",
    "Conv2d",
    "Pool2d",
    "LayerSpec",
    "as_layer_spec",
    "alexnet",
    "vgg16",
    "resnet50",
    "mlp",
    "from_units",
    "get_network",
    "count_params",
    "NETWORKS",
    # per-phase costs and memory
    "CONVENTIONS",
    "PHASE_BUCKET",
    "PhaseCost",
    "dense_layer_phases",
    "conv_model_phases",
    "domain_layer_phases",
    "engine_halo_phases",
    "window_halo_phases",
    "halo_phases",
    "exchange_phase",
    "engine_alltoall_phases",
    "engine_model_conv_phases",
    "batch_layer_phases",
    "batch_model_crossover",
    "redistribute_phase",
    "grad_norm_phase",
    "network_phases",
    "MemoryBreakdown",
    "layer_memory_bytes",
    # planner
    "MODES",
    "GridPlan",
    "PlanResult",
    "factorizations",
    "evaluate_grid",
    "price_assignment",
    "plan",
    "network_flops",
    # the engine's layer-by-layer rules (what the planner's engine mode prices)
    "ENGINE_ORDER",
    "engine_layout",
    "engine_refusal",
    "engine_layer_phases",
    "ROW_PARALLEL_MIN_WORDS",
    "row_parallel_output",
    "row_parallel_phases",
    "row_parallel_words",
    "dense_form",
]
