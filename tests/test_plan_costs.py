"""What a plan prices beside FLOPs: the bytes a compiled program sends over the
interconnect (read from its HLO), and the cache a decode step reads against the floor."""

import numpy as np
import pytest

from rl_jax.plan._collectives import collective_bytes, group_size

# Lines as XLA prints them (shapes per chip; replica groups in its three notations).
GATHER = (
    "%all-gather.5 = bf16[1024,512]{1,0:T(8,128)(2,1)S(1)} all-gather(%param), channel_id=1,"
    " replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, dimensions={0}"
)


def test_each_kind_moves_what_a_ring_over_its_group_moves():
    assert group_size(GATHER) == 4
    # A result of 1 MiB gathered over 4 chips: each receives the other three quarters.
    assert collective_bytes(GATHER)["all-gather"] == 1024 * 512 * 2 * 3 / 4
    ar = "%ar = f32[256]{0} all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%sum"
    assert collective_bytes(ar)["all-reduce"] == 2 * 256 * 4 * 1 / 2
    rs = "%rs = f32[64,8]{1,0} reduce-scatter(%x), replica_groups=[2,4]<=[8], dimensions={0}"
    assert collective_bytes(rs)["reduce-scatter"] == 64 * 8 * 4 * 3  # a shard from each
    a2a = "%a = s32[32]{0} all-to-all(%x), replica_groups=[1,8]<=[8], dimensions={0}"
    assert collective_bytes(a2a)["all-to-all"] == 32 * 4 * 7 / 8
    cp = "%cp = f32[10]{0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}"
    assert collective_bytes(cp)["collective-permute"] == 40
    # An asynchronous pair counts once, at its start: the gathered result (the larger).
    pair = (
        "%s = (bf16[16,4]{1,0}, bf16[64,4]{1,0}) all-gather-start(%x), replica_groups=[2,4]<=[8]"
        "\n%d = bf16[64,4]{1,0} all-gather-done(%s)"
    )
    assert collective_bytes(pair)["all-gather"] == 64 * 4 * 2 * 3 / 4
    # A group of one sends nothing; other ops are not collectives.
    alone = "%g = f32[8]{0} all-gather(%x), replica_groups={{0},{1}}, dimensions={0}"
    assert sum(collective_bytes(alone + "\n%f = f32[8]{0} add(%x, %y)").values()) == 0


# A program whose collectives sit in a scan (a while loop `i < 4`) inside another (`i < 2`),
# in a fusion, in a conditional's branches, and in a loop whose bound is not a constant.
NESTED = """
HloModule m

%cond.4 (p: (s32[], f32[8])) -> pred[] {
  %c = s32[]{:T(128)} constant(4)
  %g = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%g, %c), direction=LT
}

%layer (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[32]{0} all-gather(%x), replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %t = (s32[], f32[8]) tuple(%i, %y)
}

%cond.2 (p: (s32[], f32[8])) -> pred[] {
  %c = s32[] constant(2)
  ROOT %lt = pred[] compare(%g, %c), direction=LT
}

%minibatch (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %w = (s32[], f32[8]) while(%p), condition=%cond.4, body=%layer
  %f = f32[8] fusion(%w), kind=kLoop, calls=%fused
  ROOT %t = (s32[], f32[8]) tuple(%i, %f)
}

%fused (p: f32[8]) -> f32[8] {
  ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%sum
}

%cond.dynamic (p: (s32[], f32[8])) -> pred[] {
  ROOT %done = pred[] reduce(%flags, %false), to_apply=%or
}

%small (p: f32[8]) -> f32[8] {
  ROOT %cp = f32[8]{0} collective-permute(%p), source_target_pairs={{0,1}}
}

%large (p: f32[8]) -> f32[8] {
  ROOT %cp = f32[16]{0} collective-permute(%p), source_target_pairs={{0,1}}
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t), condition=%cond.2, body=%minibatch
  %d = (s32[], f32[8]) while(%t), condition=%cond.dynamic, body=%layer
  ROOT %b = f32[8] conditional(%pred, %x, %x), true_computation=%small, false_computation=%large
}
"""


def test_collectives_in_loops_count_once_per_iteration():
    got = collective_bytes(NESTED)
    gather = 32 * 4 * 3 / 4  # one layer's all-gather
    # 2 minibatches x 4 layers, and once more for the loop without a constant bound.
    assert got["all-gather"] == pytest.approx((2 * 4 + 1) * gather)
    assert got["all-reduce"] == pytest.approx(2 * (2 * 8 * 4 * 3 / 4))  # the fusion's, x 2
    assert got["collective-permute"] == 16 * 4  # the conditional's larger branch


def test_a_compiled_gather_is_counted_for_a_tpu_topology(no_compilation_cache):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from test_plan import _libtpu

    _libtpu()
    from rl_jax.plan import topology_devices

    mesh = Mesh(np.array(topology_devices("v5e:2x2")).reshape(4), ("x",))
    a = jax.ShapeDtypeStruct(
        (1024, 512), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec("x", None))
    )
    whole = NamedSharding(mesh, PartitionSpec())

    def f(a):
        return jax.lax.with_sharding_constraint(a, whole).sum(0)

    compiled = jax.jit(f, out_shardings=whole).lower(a).compile()
    sent = collective_bytes(compiled.as_text())
    # The 1 MiB array is gathered whole on every chip (or reduced after a local sum: the
    # compiler's choice); either way it is counted, never zero.
    assert sent["all-gather"] == pytest.approx(1024 * 512 * 2 * 3 / 4) or sent["all-reduce"] > 0


def test_a_paged_decode_step_reads_the_filled_pages_near_the_floor():
    """ScaleRL's rows (1,024 prompt + 14,336 new tokens) on the TPU engine's pages of 64
    positions: a step reads a row's filled pages in the kernel's blocks, on average
    close to the positions it attends; XLA's reference reads the whole table, and so
    does the TPU engine where the kernel cannot read its cache (int8 keys and values, a
    head width that is not whole 128-lane tiles)."""
    from types import SimpleNamespace

    from rl_jax.kernels import tpu, xla
    from rl_jax.plan._programs import _mean_filled, _mean_pages_read

    tp, tg, page = 1024, 14336, 64
    width = (tp + tg) // page

    def engine(ops, head_dim=128, kv_quant=None):
        spec = SimpleNamespace(head_dim=head_dim, compute_dtype="bfloat16")
        return SimpleNamespace(
            decode_ops=ops, page_size=page, row_pages=width, spec=spec, kv_quant=kv_quant
        )

    read = _mean_pages_read(engine(tpu.Decode("tpu")), tp, tg) * page
    floor = _mean_filled(tp, tg)
    assert floor == 1024 + 7168.5
    # Blocks of 512 positions: on average half a block (256) more than the filled part.
    assert 1.0 < read / floor < 1.05
    assert _mean_pages_read(engine(xla.Decode("cpu")), tp, tg) == width
    assert _mean_pages_read(engine(tpu.Decode("tpu"), kv_quant="int8"), tp, tg) == width
    assert _mean_pages_read(engine(tpu.Decode("tpu"), head_dim=64), tp, tg) == width
