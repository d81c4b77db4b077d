"""cupyln.jax's calls partitioned by rows under ``jax.jit`` with sharded arrays.

XLA cannot see into a buffer callback, so by itself it would gather a sharded x onto every
device before the call. ``by_rows`` tells it what the kernels need (``custom_partitioning``):
each device normalizes its own rows of x (the rows split over the mesh axes that shard x's
first dimension), the width and the weights whole on every device; per-row outputs stay split
like x, and outputs summed over the rows (dw, db) are summed over those axes (``psum``, in
float32 or wider). A width split over devices is gathered first (a row needs all of it), as is
a row count that the axes do not divide evenly. On one device the call is the plain call.
"""

from __future__ import annotations

import math
from functools import cache

import jax
import jax.numpy as jnp
from jax.custom_batching import sequential_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ROWS, WHOLE, SUM = "rows", "whole", "sum"  # an array's kind: split by rows, whole, summed


def _row_axes(mesh, sharding, m: int):
    """The mesh axes splitting the rows of an (m, ...) operand, or None (rows whole)."""
    spec = getattr(sharding, "spec", None)
    if not spec or spec[0] is None:
        return None
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    shards = math.prod(mesh.shape[a] for a in axes)
    return axes if shards > 1 and m % shards == 0 else None


def psum_wide(a, axes):
    """``a`` summed over the mesh ``axes`` in float32 (or a's own wider dtype), back in a's."""
    return jax.lax.psum(a.astype(jnp.promote_types(a.dtype, jnp.float32)), axes).astype(a.dtype)


def _spec(kind: str, ndim: int, axes) -> P:
    return P(axes, *([None] * (ndim - 1))) if kind == ROWS and axes else P()


def _shardings(kinds_in, kinds_out, mesh, arg_shapes, result_shape):
    """(row axes, operands' shardings, outputs' shardings) of the call: the rows split as the
    first row operand that is split."""
    m = arg_shapes[0].shape[0]
    split = (_row_axes(mesh, a.sharding, m) for k, a in zip(kinds_in, arg_shapes)
             if k == ROWS and len(a.shape) and a.shape[0] == m)  # fmt: skip
    axes = next((a for a in split if a is not None), None)  # (a gradient may come whole)
    args = tuple(NamedSharding(mesh, _spec(k, len(a.shape), axes))
                 for k, a in zip(kinds_in, arg_shapes))  # fmt: skip
    results = tuple(NamedSharding(mesh, _spec(k, len(r.shape), axes))
                    for k, r in zip(kinds_out, result_shape))  # fmt: skip
    return axes, args, results


def _infer(static, kinds_in, kinds_out, mesh, arg_shapes, result_shape):
    """The outputs' shardings (the GSPMD partitioner's question; Shardy reads _rule)."""
    return _shardings(kinds_in, kinds_out, mesh, arg_shapes, result_shape)[2]


def _partition(body, static, kinds_in, kinds_out, mesh, arg_shapes, result_shape):
    axes, args, results = _shardings(kinds_in, kinds_out, mesh, arg_shapes, result_shape)

    def lower(*arrays):
        outs = body(static, *arrays)
        if axes is None:
            return outs
        return tuple(psum_wide(o, axes) if k == SUM else o for k, o in zip(kinds_out, outs))

    return mesh, lower, results, args


def _rule(static, kinds_in, kinds_out, mesh, operand_types, result_types):
    """Shardy's rule: factor m for the rows, n for the width (x's last dimension and the
    vectors of its length; never split), a factor of its own for any other dimension."""
    extra = iter(f"k{i}" for i in range(64))
    n = list(operand_types[0].shape)[1]

    def factors(kind, ir_type):
        dims = list(ir_type.shape)
        if kind == ROWS:  # (a quantized y's elements and scales: widths of their own)
            width = ["n" if dims[1] == n else next(extra)] if len(dims) > 1 else []
            return " ".join(["m"] + width + [next(extra) for _ in dims[2:]])
        return " ".join("n" if d == n and i == 0 else next(extra) for i, d in enumerate(dims))

    lhs = ", ".join(factors(k, t) for k, t in zip(kinds_in, operand_types))
    rhs = ", ".join(factors(k, t) for k, t in zip(kinds_out, result_types))
    return f"{lhs} -> {rhs}", {"need_replication_factors": ("n",)}


def by_rows(body):
    """``call(static, kinds_in, kinds_out, *arrays)``: ``body(static, *arrays)`` (a tuple of
    arrays) partitioned by rows; ``arrays[0]`` is an (m, n) operand of kind ROWS; ``kinds_in``
    and ``kinds_out`` give every operand's and output's kind (ROWS, WHOLE, SUM). Under
    ``jax.vmap`` it runs once per batch element (``custom_partitioning`` has no batching rule
    of its own), as the buffer callback inside does. An eager call on arrays of one device
    each is the plain call: both wrappers trace their function at every eager call, which
    costs far more host time than the call, and have nothing to do there."""

    def fn(static, kinds_in, kinds_out, *arrays):
        return body(static, *arrays)

    part = custom_partitioning(fn, static_argnums=(0, 1, 2))
    part.def_partition(
        partition=lambda *a: _partition(body, *a),
        infer_sharding_from_operands=_infer,
        sharding_rule=_rule,
    )

    @cache
    def mapped(static, kinds_in, kinds_out):
        def one(*arrays):
            return part(static, kinds_in, kinds_out, *arrays)

        return sequential_vmap(one)

    def call(static, kinds_in, kinds_out, *arrays):
        if all(_on_one_device(a) for a in arrays):
            return body(static, *arrays)
        return mapped(static, kinds_in, kinds_out)(*arrays)

    return call


def given(arrays) -> tuple:
    """(the arrays that are not None, which are) for a call's optional operands."""
    return tuple(a for a in arrays if a is not None), tuple(a is not None for a in arrays)


def taken(present, arrays) -> list:
    """The optional operands back in their places, None where absent."""
    arrays = iter(arrays)
    return [next(arrays) if p else None for p in present]


def devices(a):
    """The devices holding a concrete array ``a``, or None for a tracer (under a
    transformation XLA places it, and nothing runs eagerly)."""
    try:
        return a.devices()
    except Exception:  # noqa: BLE001 - a tracer's devices() raises
        return None


def _on_one_device(a) -> bool:
    """Whether ``a`` is a concrete array on a single device."""
    held = devices(a)
    return held is not None and len(held) == 1
