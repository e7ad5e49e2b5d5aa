"""The JaxEngine against `transformers` itself (an independent oracle, not our own forward): a
tiny random Qwen2 checkpoint (GQA, biases, tied embeddings) written by transformers, loaded by
`from_pretrained` into the engine on the dense and the paged KV layout. Every completion
token's behaviour log-prob must equal transformers' log-softmax over the whole sequence, and
greedy tokens its argmax, across prompt lengths that do and do not fill whole pages."""
import numpy as np
import pytest

from tests.optional_deps import optional  # noqa: E402

torch = optional("torch")
transformers = optional("transformers")

from pipelinerl_jax.models import from_pretrained  # noqa: E402
from tests.rollout.conftest import make_engine, request, run_until  # noqa: E402

VOCAB = 97


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=80,
                                   num_hidden_layers=2, num_attention_heads=6,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=True, rope_theta=1e6)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked distributions: greedy is decided, KV mistakes show
        for p in model.parameters():
            p.mul_(6.0 if p.ndim >= 2 else 1.0).add_(0.1 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp("qwen2"))
    model.save_pretrained(path)
    return path, model


def _hf_logp(model, prompt, tokens):
    ids = torch.from_numpy(np.concatenate([prompt, tokens]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1).numpy()
    return logp, logp[np.arange(len(tokens)), tokens]


@pytest.mark.parametrize("layout", [{}, {"kv_layout": "paged", "page_size": 8}],
                         ids=["dense", "paged"])
def test_engine_log_probs_match_transformers(checkpoint, layout):
    path, hf = checkpoint
    eng = make_engine(from_pretrained(path), **layout)
    rng = np.random.default_rng(3)
    reqs = []
    for i, plen in enumerate((5, 8, 13, 16)):  # 8 and 16 fill whole pages of 8
        prompt = rng.integers(0, VOCAB, plen).astype(np.int32)
        reqs.append(request(f"g{i}", prompt, max_new_tokens=20, temperature=0.0))
        reqs.append(request(f"s{i}", prompt, max_new_tokens=20, temperature=1.0, seed=i, n=2))
    for r in reqs:
        eng.submit(r)
    done = run_until(eng, sum(r.params.n for r in reqs))
    assert len(done) == 12
    for c in done:
        full, ours = _hf_logp(hf, c.prompt_ids, c.token_ids)
        if c.request_id.startswith("g"):  # greedy: the engine reports T=1 log-probs too
            np.testing.assert_array_equal(c.token_ids, full.argmax(-1), err_msg=c.request_id)
        np.testing.assert_allclose(c.logp_behaviour, ours, atol=2e-4, err_msg=c.request_id)
