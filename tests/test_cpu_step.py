"""The compiled CPU step: Llama-family targets decode and verify through one C call over the static cache; a token's
logits are the same bits alone, in a tree or beside other batch rows, and close to the model's own; other layouts, a
look-alike and a machine without a compiler keep transformers' step."""
import gguf as gguf_quants
import pytest
import torch

from mamba_draft.devices import cpu_info
from mamba_draft.targets import cpu_step, native
from mamba_draft.targets.cache import TargetCache
from mamba_draft.targets.facts import UnsupportedTargetError
from mamba_draft.tree import Tree
from tests.helpers.tree_models import aligned_drafter, tiny_causal_lm
from tree_search.generate import generate, generate_autoregressive

CHAIN = Tree((-1, 0, 1, 2))


def _model(kind: str, dtype: torch.dtype, gguf: bool = False, hidden: int = 64):
    model = tiny_causal_lm(kind, hidden=hidden, layers=2)  # head dim hidden / 4
    if gguf:  # a GGUF of a bf16 checkpoint as transformers dequantizes it: Q4_1 products, a Q8_0 head
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2 and "embed" not in name:
                    p.copy_(_gguf_values(p.bfloat16().float(), "Q8_0" if "lm_head" in name else "Q4_1"))
    return model.to(dtype)


def _gguf_values(weight: torch.Tensor, kind: str) -> torch.Tensor:
    kind = getattr(gguf_quants.GGMLQuantizationType, kind)
    blocks = gguf_quants.quantize(weight.detach().numpy(), kind)
    return torch.from_numpy(gguf_quants.dequantize(blocks, kind).copy()).view(weight.shape)


def _prefilled(model, prompts: list[list[int]], max_len: int = 48) -> TargetCache:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    cache = TargetCache(model, max_len=max_len, static=True)
    assert cache.step is not None
    cache.prefill(ids, mask)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_tree_and_decoding_steps_give_the_same_bits_close_to_the_model(kind, dtype):
    model = _model(kind, dtype)
    prompt, chain = [5, 9, 17, 3, 22, 41], [7, 30, 2, 11]
    tree = _prefilled(model, [prompt])
    verified, _ = tree.tree_forward(torch.tensor([chain]), CHAIN)
    steps = _prefilled(model, [prompt])
    decoded = torch.stack([steps.decode(torch.tensor([t]))[0] for t in chain])
    assert torch.equal(verified[0], decoded)  # bit for bit
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([prompt + chain])).logits[0, len(prompt):].float()
    spread = float(reference.max() - reference.min())
    assert (verified[0].float() - reference).abs().max() < (0.02 if dtype == torch.float32 else 0.06) * spread
    assert torch.equal(verified[0].argmax(-1), reference.argmax(-1))
    with pytest.raises(IndexError, match="token ids must be in"):  # checked before any memory is read
        steps.decode(torch.tensor([64]))


@pytest.mark.parametrize("gguf", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_rows_equal_their_prompts_alone(dtype, gguf):
    model = _model("llama", dtype, gguf)
    if gguf:  # coded weights; 12 rows share each product (the many-row path)
        assert cpu_step.CpuStep(model).layers[0].q.codes == 4
    prompts = [[5, 9, 17, 3, 22, 41, 8], [12, 4], [33, 2, 19, 60]]
    batch = _prefilled(model, prompts)
    nexts = torch.tensor([[7, 30, 2, 11], [1, 1, 5, 6], [40, 3, 3, 9]])
    together, _ = batch.tree_forward(nexts, CHAIN)
    for b, prompt in enumerate(prompts):
        alone = _prefilled(model, [prompt])
        for t in range(nexts.shape[1]):
            assert torch.equal(alone.decode(nexts[b, t : t + 1]), together[b, t : t + 1])


def test_speculation_through_the_step_equals_plain_decoding(tmp_path, monkeypatch):
    target = tiny_causal_lm("llama", hidden=64).to(torch.bfloat16)
    drafter = aligned_drafter(tmp_path, target)
    calls = []
    forward = cpu_step.CpuStep.forward
    monkeypatch.setattr(cpu_step.CpuStep, "forward", lambda self, *a: calls.append(a[0].shape) or forward(self, *a))
    prompts = torch.tensor([[0, 0, 5, 9, 17], [3, 8, 1, 4, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    plain = generate_autoregressive(target, prompts, attention_mask=mask, max_new_tokens=24)
    fast = generate(target, drafter, prompts, attention_mask=mask, tree=[2, 1, 1], max_new_tokens=24)
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(fast.rows, plain.rows))
    assert fast.stats.rounds < plain.stats.rounds
    assert any(shape[1] > 1 for shape in calls) and any(shape[1] == 1 for shape in calls)  # trees and steps


def test_other_layouts_a_look_alike_and_no_compiler_keep_the_eager_step(monkeypatch, capsys):
    assert cpu_step.CpuStep.of(tiny_causal_lm("neox")) is None
    assert cpu_step.CpuStep.of(tiny_causal_lm("llama", hidden=40)) is None  # widths outside the kernel's blocks
    look_alike = _model("llama", torch.float32)
    look_alike.model.embed_tokens.register_forward_hook(lambda module, args, out: out * 3.0)
    assert cpu_step.CpuStep.of(look_alike) is None  # fails the probe
    model = _model("llama", torch.float32)
    assert cpu_step.CpuStep.of(model) is not None
    monkeypatch.setenv(cpu_step.SWITCH, "0")
    assert cpu_step.CpuStep.of(model) is None
    monkeypatch.delenv(cpu_step.SWITCH)
    monkeypatch.setattr(cpu_step, "library", lambda: (_ for _ in ()).throw(native.KernelUnavailable("no compiler")))
    cpu_step._compiler_missing.cache_clear()
    assert cpu_step.CpuStep.of(model) is None and cpu_step.CpuStep.of(model) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "eager step" in err
    cache = TargetCache(model, max_len=32, static=True)  # the static cache runs transformers' forward
    assert cache.step is None
    cache.prefill(torch.tensor([[5, 9, 17]]))
    assert cache.decode(torch.tensor([4])).shape == (1, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_portable_build_computes_the_same_bits(tmp_path, monkeypatch, dtype):
    """The kernel's bits do not depend on the instructions the compiler picked: the library built without
    -march=native (scalar fused multiply-adds, no AVX intrinsics) gives a tree forward the native build's bits."""
    cc = native.c_compiler()
    path = tmp_path / "portable.so"
    native.subprocess.run([cc, *native.FLAGS, "-fopenmp", "-I", str(cpu_step.SOURCE.parent), "-o", str(path),
                           str(cpu_step.SOURCE), "-lm"], check=True, capture_output=True)
    portable = cpu_step.declare(native.ctypes.CDLL(str(path)))
    model = _model("llama", dtype, gguf=True, hidden=256)  # coded weights decoded (and rounded to bf16); head dim 64
    results = []
    for lib in (cpu_step.library(), portable):
        monkeypatch.setattr(cpu_step, "library", lambda lib=lib: lib)
        cache = _prefilled(model, [[5, 9, 17, 3], [22, 41]])
        results.append(cache.tree_forward(torch.tensor([[7, 30, 2, 11], [1, 2, 3, 4]]), CHAIN, want_hidden=True))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_ggufs_weights_run_coded_with_the_plain_weights_bits(dtype):
    """Q4_1 / Q8_0 values are stored as their codes and scales and rebuilt exactly: the step's logits and states are
    the bits of the same step over the plain packed weights, for one row, a few rows and many."""
    model = _model("llama", dtype, gguf=True)
    coded, plain = cpu_step.CpuStep(model), cpu_step.CpuStep(model, codes=False)
    assert [coded.layers[0].q.codes, coded.layers[1].down.codes, coded.struct.head.codes] == [4, 4, 8]
    assert plain.layers[0].q.codes == plain.struct.head.codes == 0
    for n in (1, 3, 9):
        outputs = []
        for step in (coded, plain):
            keys = [torch.zeros(2, 2, 16, 16, dtype=dtype) for _ in range(2)]
            values = [torch.zeros_like(k) for k in keys]
            mask = torch.ones(n, 16, dtype=torch.bool).tril_()[None, None].expand(2, 1, n, 16)
            ids = torch.arange(2 * n).view(2, n) % 64
            outputs.append(step.forward(ids, mask, torch.arange(n).expand(2, n), torch.arange(n), n, keys, values,
                                        True))
        assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])


def test_encode_codes_only_weights_it_rebuilds_exactly():
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    assert cpu_step.encode(weight)[1] == 0  # float32 values of no coded form
    assert cpu_step.encode(weight.bfloat16().float())[1] == 16  # bf16 values: kept in bf16
    q4 = _gguf_values(weight, "Q4_1")
    assert cpu_step.encode(q4)[1] == 4 and cpu_step.encode(_gguf_values(weight, "Q8_0"))[1] == 8
    q4[5, 7] = q4[5, 7] + 1e-3  # one value off its group's grid
    assert cpu_step.encode(q4)[1] == 0
    data, bits = cpu_step.encode(_gguf_values(weight, "Q4_1"))
    assert bits == 4 and data.numel() == 32 * 64 // 2 + 2 * 4 * 32 * 2  # half a byte a weight, a scale and offset



def test_weights_edited_in_place_are_packed_again():
    """An in-place edit between calls (an optimizer step, `load_state_dict`) keeps the parameters' addresses, so the
    static cache and its step are reused: the step's watched version counters make it pack the new values."""
    model = _model("llama", torch.float32)
    prompt = [5, 9, 17, 3]
    first = TargetCache.for_call(model, max_len=32)
    first.prefill(torch.tensor([prompt]))
    before = first.decode(torch.tensor([7]))[0]
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(3)
    again = TargetCache.for_call(model, max_len=32, kept=first)
    assert again is first  # the same static cache and step
    again.prefill(torch.tensor([prompt]))
    after = again.decode(torch.tensor([7]))[0]
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([prompt + [7]])).logits[0, -1].float()
    assert not torch.equal(after, before)
    assert (after.float() - reference).abs().max() < 0.02 * float(reference.max() - reference.min())


def _integer_product(lib, tiles: torch.Tensor, bits: int, x: torch.Tensor, outs: int) -> torch.Tensor:
    weight = cpu_step.Weight(tiles.data_ptr(), bits, 1)
    out = torch.empty(x.shape[0], outs)
    assert lib.cpu_linear(x.data_ptr(), x.shape[0], x.shape[1], native.ctypes.byref(weight), None, outs,
                          out.data_ptr(), 0, 2) == 0
    return out


def _integer_reference(x: torch.Tensor, weight: torch.Tensor, kind: str) -> torch.Tensor:
    """int_products.c's definition, in float64 (the integer sums exact, each float operation rounded to float32)."""
    rows, inner = x.shape
    groups = x.view(rows, inner // 32, 32)
    scale = groups.abs().amax(-1) / 127.0
    codes = torch.round(groups * torch.where(scale > 0, 1.0 / scale, 0.0)[..., None]).clamp_(-127, 127)
    blocks = weight.view(weight.shape[0], inner // 32, 32).double()
    if kind == "Q4_1":
        offset = blocks.amin(-1)
        steps = (blocks.amax(-1) - offset) / 15
    else:
        offset, steps = torch.zeros_like(blocks[..., 0]), blocks.abs().amax(-1) / 127
    w_codes = torch.round((blocks - offset[..., None]) / torch.where(steps > 0, steps, 1)[..., None])
    isum = torch.einsum("mgk,ngk->mng", codes.double(), w_codes)
    f32 = lambda t: t.float().double()  # noqa: E731
    acc = torch.zeros(rows, weight.shape[0], dtype=torch.float64)
    for g in range(inner // 32):
        acc = f32(isum[..., g] * f32(f32(steps[:, g])[None] * f32(scale[:, g])[:, None]) + acc)
        if kind == "Q4_1":
            acc = f32(f32(offset[:, g])[None] * f32(scale[:, g] * codes[:, g].sum(-1))[:, None] + acc)
    return acc.float()


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_integer_products_are_the_same_bits_on_every_instruction_set_and_row_count(kind, tmp_path):
    """A GGUF's codes multiplied as integers (`int_products.c`): the portable, AVX2, AVX512, AVX512-VNNI and native
    builds (on an AMX machine its tiles from 4 rows on, VNNI below) give every row the same bits, alone or among 1-33
    rows, and the definition's value (a float64 reference) within float32 rounding. Each build runs the CPU kinds'
    paths that this machine can run (a machine cannot run a wider one than it has: the others build and are skipped
    where their instructions are missing)."""
    cc = native.c_compiler()
    builds = {"native": cpu_step.library()}
    has = set(cpu_info("flags").split())
    avx512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma"]
    for name, flags, needs in (("portable", [], set()), ("avx2", ["-mavx2", "-mfma"], {"avx2", "fma"}),
                               ("avx512", avx512, {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}),
                               ("vnni", [*avx512, "-mavx512vnni"],
                                {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})):
        if not needs <= has:  # instructions this CPU lacks: the build would not run here
            continue
        path = tmp_path / f"{name}.so"
        built = native.subprocess.run([cc, *native.FLAGS, "-fopenmp", *flags, "-I", str(cpu_step.SOURCE.parent), "-o",
                                       str(path), str(cpu_step.SOURCE), "-lm"], capture_output=True)
        if built.returncode == 0:  # a compiler without those targets builds the others
            builds[name] = cpu_step.declare(native.ctypes.CDLL(str(path)))
    assert "portable" in builds
    torch.manual_seed(3)
    weight = _gguf_values(torch.randn(48, 160).bfloat16().float(), kind)
    tiles, bits = cpu_step.encode(weight, integer=True)
    assert bits == (4 if kind == "Q4_1" else 8)
    x = torch.randn(33, 160) * 2
    x[2, :32] = 0  # a group of zeros
    x[3, 5] = 1e4  # and one outlier
    together = {name: _integer_product(lib, tiles, bits, x, 48) for name, lib in builds.items()}
    for name, out in together.items():
        assert torch.equal(out, together["portable"]), name
    for rows in (1, 3, 4, 5, 17):
        alone = _integer_product(builds["native"], tiles, bits, x[-rows:].contiguous(), 48)
        assert torch.equal(alone, together["native"][-rows:]), rows
    reference = _integer_reference(x, weight, kind)
    assert torch.allclose(together["native"], reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
    plain = x @ weight.T  # and close to the float product: 8-bit activations
    assert (together["native"] - plain).abs().max() < 0.02 * plain.abs().max()


def test_integer_products_decode_speculatively_as_plainly_and_close_to_the_model(tmp_path):
    model = _model("llama", torch.float32, gguf=True)
    drafter = aligned_drafter(tmp_path, model)
    prompts = torch.tensor([[0, 0, 5, 9, 17], [3, 8, 1, 4, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    plain = generate_autoregressive(model, prompts, attention_mask=mask, max_new_tokens=24, integer_products=True)
    for tree in ([2, 1, 1], [3, 2, 2, 1, 1]):
        fast = generate(model, drafter, prompts, attention_mask=mask, tree=tree, max_new_tokens=24,
                        integer_products=True)
        assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(fast.rows, plain.rows)), tree
    cache = TargetCache(model, max_len=48, static=True, integer_products=True)
    assert cache.step.has_integer_products
    cache.prefill(torch.tensor([[5, 9, 17, 3]]))
    verified, _ = cache.tree_forward(torch.tensor([[7, 30, 2, 11]]), CHAIN)
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([[5, 9, 17, 3, 7, 30, 2, 11]])).logits[0, 4:]
    assert (verified[0] - reference).abs().max() < 0.05 * float(reference.max() - reference.min())


def test_integer_products_prefill_a_short_prompt_in_one_step_as_its_tokens_decoded_one_by_one(monkeypatch):
    """With integer products a prompt of up to STEP_PREFILL tokens is prefilled by one call of the step (the head
    for its last token only): the same bits as its tokens decoded one at a time; a longer prompt goes through
    transformers' forward; either way a row of a batch equals its prompt alone."""
    from mamba_draft.targets import cache as cache_module

    model = _model("llama", torch.float32, gguf=True)
    monkeypatch.setattr(cache_module, "STEP_PREFILL", 5)
    calls, forward = [], cpu_step.CpuStep.forward
    monkeypatch.setattr(cpu_step.CpuStep, "forward", lambda self, ids, *a, **k: calls.append(
        (ids.shape, k.get("last", False))) or forward(self, ids, *a, **k))
    prompts = [[5, 9, 17, 3, 22, 41, 8], [12, 4], [33, 2, 19, 60, 7]]

    def fresh() -> TargetCache:
        return TargetCache(model, max_len=48, static=True, integer_products=True)

    width = max(map(len, prompts))
    batch = fresh()
    calls.clear()  # the step's probe
    logits = batch.prefill(torch.tensor([[0] * (width - len(p)) + p for p in prompts]),
                           torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]))
    assert calls == [((1, 2), True), ((1, 5), True)]  # the 7-token prompt went through transformers
    nexts = torch.tensor([[7], [1], [40]])
    after = batch.decode(nexts[:, 0])
    for b, prompt in enumerate(prompts):
        alone = fresh()
        assert torch.equal(alone.prefill(torch.tensor([prompt]))[0], logits[b])
        assert torch.equal(alone.decode(nexts[b])[0], after[b])
        if len(prompt) <= 5:
            steps = fresh()
            steps.prefill(torch.tensor([prompt[:1]]))
            for token in prompt[1:]:
                last = steps.decode(torch.tensor([token]))
            assert torch.equal(last[0], logits[b])  # bit for bit


def test_integer_products_without_coded_weights_are_refused_in_one_line():
    with pytest.raises(UnsupportedTargetError, match="integer products need .* no coded weights$") as err:
        TargetCache(_model("llama", torch.float32), max_len=32, static=True, integer_products=True)
    assert "\n" not in str(err.value)


def test_products_auto_multiplies_a_ggufs_codes_as_integers_where_the_cpu_has_integer_dot_products(monkeypatch,
                                                                                                   capsys):
    from mamba_draft import targets

    coded, plain = _model("llama", torch.float32, gguf=True), _model("llama", torch.float32)
    monkeypatch.setattr("mamba_draft.devices.cpu_info", lambda field: "fpu sse2 avx avx2 fma")
    targets._say_auto_products.cache_clear()
    assert targets.integer_products("auto", coded, "coded") and not targets.integer_products("auto", plain)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--products auto multiplies coded's GGUF codes as integers" in err
    assert not targets.integer_products("float", coded) and targets.integer_products("int8", coded)
    monkeypatch.setattr("mamba_draft.devices.cpu_info", lambda field: "fpu sse2 avx")  # no integer dot products
    assert not targets.integer_products("auto", coded)
    with pytest.raises(ValueError, match="products must be one of auto, float, int8, got 'fast'"):
        targets.integer_products("fast", coded)


def test_the_kernels_build_with_the_machines_own_instructions(tmp_path):
    """The first build attempt (-march=native, OpenMP) succeeds: a source error would otherwise fall back, with a
    warning, to the portable build, right but several times slower."""
    from mamba_draft.targets import row_attention

    cc = native.c_compiler()
    for source in (cpu_step.SOURCE, row_attention.SOURCE):  # the libraries (the other sources are included)
        built = native.subprocess.run([cc, *native.FLAGS, *native.ATTEMPTS[0], "-Wall", "-I", str(source.parent), "-o",
                                       str(tmp_path / "k.so"), str(source), "-lm"], capture_output=True, text=True)
        assert built.returncode == 0 and "warning" not in built.stderr, (source.name, built.stderr[:2000])
