"""The chunked log-prob / entropy kernels (engines/algorithms/logits.py) against the plain float32 ones: same
values and same gradients, for bf16 and fp32 logits, temperature 1 and 0.7, with chunks of one token, of a few
tokens of a sequence (a short last piece) and of whole sequences (`L.CPU_CHUNK_BYTES`: these run on the CPU)."""

import pytest
import torch

from rlstages.engines.algorithms import logits as L

torch.set_num_threads(1)
# bytes of float32 per chunk for [5, 7, 50] logits: one token; 3 tokens of a sequence (7 = 3 + 3 + 1); 3 sequences
CHUNKS = [1, 3 * 50 * 4, 3 * 7 * 50 * 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_bytes", CHUNKS)
def test_chunked_matches_plain(monkeypatch, dtype, temperature, chunk_bytes):
    monkeypatch.setattr(L, "CPU_CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(5, 7, 50, generator=g) * 3).to(dtype)
    labels = torch.randint(0, 50, (5, 7), generator=g)
    weights = torch.randn(5, 7, generator=g)

    plain_in = base.clone().requires_grad_(True)
    plain = L.logprobs_from_logits(plain_in.float() / temperature, labels)
    (plain * weights).sum().backward()

    chunk_in = base.clone().requires_grad_(True)
    chunked = L.chunked_logprobs(chunk_in, labels, temperature)
    (chunked * weights).sum().backward()

    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-5)
    assert chunk_in.grad.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(chunk_in.grad.float(), plain_in.grad.float(), rtol=tol, atol=tol)
    ent = L.entropy_from_logits(base.float() / temperature)
    torch.testing.assert_close(L.chunked_entropy(base, temperature), ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_bytes", CHUNKS)
def test_chunked_entropy_gradient_matches_plain(monkeypatch, dtype, temperature, chunk_bytes):
    """The entropy bonus differentiates through the chunked entropy: same gradient as autograd's."""
    monkeypatch.setattr(L, "CPU_CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(5, 7, 50, generator=g) * 3).to(dtype)
    weights = torch.randn(5, 7, generator=g)

    plain_in = base.clone().requires_grad_(True)
    plain = L.entropy_from_logits(plain_in.float() / temperature)
    (plain * weights).sum().backward()

    chunk_in = base.clone().requires_grad_(True)
    chunked = L.chunked_entropy(chunk_in, temperature)
    (chunked * weights).sum().backward()

    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-5)
    assert chunk_in.grad.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(chunk_in.grad.float(), plain_in.grad.float(), rtol=tol, atol=tol)
    assert chunk_in.grad.abs().max() > 1e-3  # a gradient that is really there


def test_chunked_entropy_without_grad_builds_no_graph():
    logits = torch.randn(2, 3, 11, requires_grad=True)
    with torch.no_grad():
        assert L.chunked_entropy(logits).grad_fn is None
    assert L.chunked_entropy(logits).grad_fn is not None


def test_chunked_rejects_bad_temperature():
    with pytest.raises(ValueError, match="temperature"):
        L.chunked_logprobs(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="temperature"):
        L.chunked_entropy(torch.zeros(1, 1, 3), 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_bytes", CHUNKS)
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_fused_pass_matches_the_two_kernels(monkeypatch, dtype, temperature, chunk_bytes, entropy_grad):
    """`chunked_logprobs_entropy` (one pass, one logsumexp, one gradient buffer) gives the values and the
    gradient of `chunked_logprobs` + `chunked_entropy` (the old path); its entropy is outside the graph unless
    `entropy_grad`."""
    monkeypatch.setattr(L, "CPU_CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(2)
    base = (torch.randn(5, 7, 50, generator=g) * 3).to(dtype)
    labels = torch.randint(0, 50, (5, 7), generator=g)
    w_lp, w_ent = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)

    old_in = base.clone().requires_grad_(True)
    old_lp = L.chunked_logprobs(old_in, labels, temperature)
    with torch.set_grad_enabled(entropy_grad):
        old_ent = L.chunked_entropy(old_in, temperature)
    old_loss = (old_lp * w_lp).sum() + ((old_ent * w_ent).sum() if entropy_grad else 0.0)
    old_loss.backward()

    new_in = base.clone().requires_grad_(True)
    new_lp, new_ent = L.chunked_logprobs_entropy(new_in, labels, temperature, entropy_grad)
    assert new_ent.requires_grad == entropy_grad
    new_loss = (new_lp * w_lp).sum() + ((new_ent * w_ent).sum() if entropy_grad else 0.0)
    new_loss.backward()

    torch.testing.assert_close(new_lp, old_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(new_ent, old_ent.detach(), rtol=1e-6, atol=1e-6)
    assert new_in.grad.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(new_in.grad.float(), old_in.grad.float(), rtol=tol, atol=tol)
    assert new_in.grad.abs().max() > 1e-3


def test_fused_entropy_alone_has_the_entropy_gradient():
    """Only the entropy in the loss (the log-probs' gradient absent): the fused backward's entropy branch alone."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(3, 4, 20, generator=g)
    labels = torch.randint(0, 20, (3, 4), generator=g)
    a, b = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    L.chunked_entropy(a, 0.7).sum().backward()
    L.chunked_logprobs_entropy(b, labels, 0.7, entropy_grad=True)[1].sum().backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        lp, ent = L.chunked_logprobs_entropy(base.requires_grad_(True), labels, 1.0, entropy_grad=True)
    assert lp.grad_fn is None and ent.grad_fn is None
    with pytest.raises(ValueError, match="temperature"):
        L.chunked_logprobs_entropy(base, labels, -1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_gpu_one_kernel_shift_equals_the_cpu_one(dtype, temperature):
    """The fused backward's z/T - lse: the GPU's one mixed-dtype kernel and the CPU's copy + in-place ops agree."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 5, 40, generator=g) * 3).to(dtype)
    lse = torch.randn(3, 5, generator=g)
    one = L._shifted(logits, lse, 1 / temperature, one_kernel=True)
    two = L._shifted(logits, lse, 1 / temperature, one_kernel=False)
    assert one.dtype == two.dtype == torch.float32
    torch.testing.assert_close(one, two, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(two, logits.float() / temperature - lse[..., None], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grads", ["logp", "both", "entropy"])
def test_the_compiled_gpu_kernels_compute_the_eager_chunks_values(monkeypatch, dtype, grads):
    """`fused_logits` (what a GPU runs compiled to Triton) traced whole (fullgraph, dynamic shapes; the CPU
    traces it with aot_eager) gives the eager chunks' log-probs, entropy and logits gradient, for each set of
    gradients the loss can carry."""
    from rlstages.engines.algorithms import fused_logits as F

    monkeypatch.setattr(L, "CHUNK_BYTES", 2 * 6 * 40 * 4)  # two rows a chunk: the loop and a short last chunk
    torch._dynamo.reset()  # a fresh compile cache: earlier tests' traces do not count toward the recompile limit
    monkeypatch.setattr(F.KERNELS, "compiled", {})
    monkeypatch.setattr(F.KERNELS, "failed", set())
    monkeypatch.setattr(F.KERNELS, "backend", "aot_eager")
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(5, 6, 40, generator=g) * 3).to(dtype)
    labels = torch.randint(0, 40, (5, 6), generator=g)
    temperature = 0.7
    inv_t = 1 / temperature

    ref_in = logits.clone().requires_grad_(True)
    ref_lp, ref_ent = L.chunked_logprobs_entropy(ref_in, labels, temperature, entropy_grad=grads != "logp")
    w_lp, w_ent = torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)
    loss = (ref_lp * w_lp).sum() * (grads != "entropy") + ((ref_ent * w_ent).sum() if grads != "logp" else 0.0)
    loss.backward()

    out, lse, ent = (torch.empty(5, 6) for _ in range(3))
    assert L._fused_forward(logits, labels, inv_t, out, lse, ent)
    torch.testing.assert_close(out, ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=1e-5, atol=1e-5)
    grad = torch.empty_like(logits)
    grad_logp = None if grads == "entropy" else w_lp
    grad_ent = None if grads == "logp" else w_ent
    assert L._fused_backward(logits, labels, lse, ent, grad_logp, grad_ent, inv_t, grad)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grad.float(), ref_in.grad.float(), rtol=tol, atol=tol)
    assert grad.dtype == dtype and grad.abs().max() > 1e-3


def test_cpu_chunks_cover_every_token_once_within_the_bound(monkeypatch):
    """`_chunks` on the CPU: every token of [B, T, V] logits in exactly one chunk, each chunk's float32 within
    `CPU_CHUNK_BYTES` (or one token), whole sequences only while one fits."""
    logits = torch.zeros(4, 9, 10)
    for budget, pieces in ((1, 36), (4 * 10 * 4, 12), (9 * 10 * 4, 4), (2 * 9 * 10 * 4, 2), (1 << 30, 1)):
        monkeypatch.setattr(L, "CPU_CHUNK_BYTES", budget)
        seen = torch.zeros(4, 9)
        chunks = L._chunks(logits)
        for index in chunks:
            seen[index] += 1
            assert logits[index].numel() * 4 <= max(budget, 10 * 4)
        assert len(chunks) == pieces and bool((seen == 1).all())
