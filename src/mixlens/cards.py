"""The hand-written part of each method's reference card (docs/reference/methods.md), without torch.

A card holds what the registry cannot derive: the definition (the math, after the paper's quantities), the cost
(passes and the order of the memory they hold) and the official implementation the method was compared with, the
tolerance that comparison measured and the test (or benchmark) that measures it. Axes, options, capabilities and
refusals come from the registry's catalog (`mixlens.catalog`); `scripts/method_reference.py` joins both into the
page, and `tests/cli/test_method_reference.py` fails when a registered method has no complete card or the page is
out of date. Only comparisons that were measured are named; otherwise `official` is `NONE`.

Notation: n tokens, L layers, H heads, d hidden size, α^h_ij attention of head h, f^h(x) = (x W_V^h + b_V^h) W_O^h,
t_ij = Σ_h α^h_ij f^h(x_j) + [i=j] x_i (attention plus residual), g_i a norm as the linear map at target i, g the
explained scalar (a logit, a logit difference with a foil, or an encoder's pooled projection), e_j the word
embedding of token j.
"""

from __future__ import annotations

from dataclasses import dataclass

NONE = "none compared"
TRACED = "One traced forward pass (shared with the other methods of the run), no backward"


@dataclass(frozen=True)
class Card:
    """One method's hand-written reference: `definition` (one or two lines of math), `passes` (forward/backward
    counts), `memory` (order of what it holds, e.g. [L, n, n], and whether it has a row mode), `official` (the
    official implementation it equals, or `NONE`), `tolerance` (measured and asserted, empty with `NONE`) and
    `check` (the test or benchmark that measures it, `path::name`, empty with `NONE`); `note` an optional remark on
    the comparison."""

    definition: str
    passes: str
    memory: str
    official: str = NONE
    tolerance: str = ""
    check: str = ""
    note: str = ""  # a remark on the comparison (what was checked instead, why none exists)


ALTI_LOGIT_CHECK = (
    "tests/methods/test_alti_logit.py::test_equals_the_authors_code_on_gpt2 (and "
    "::test_equals_the_authors_code_on_opt_and_bloom); skipped unless MIXLENS_LOGIT_EXPLANATIONS names a checkout"
)
FLOW_CHECK = (
    "tests/methods/test_flow_routes.py::test_equals_the_authors_tool_end_to_end (the tool's stored output) and "
    "::test_equals_the_authors_tool (live, when MIXLENS_LLM_TT names the tool)"
)
ROLLOUT_MEMORY = "[L, n, n]; with --rows only the requested rows, streamed layer by layer ([L, t, n])"

CARDS: dict[str, Card] = {
    "attention": Card(
        "α^h_ij = softmax_j(q_i·k_j / √d_h + mask), the model's own attention probabilities; head mean "
        "(1/H) Σ_h α^h_ij unless heads=True.",
        TRACED + ".",
        "[L, H, n, n] while traced; on a causal LM read by rows from q, K and the softmax normaliser (row mode, "
        "no [H, n, n]); output [L, n, n] or [L, H, n, n].",
    ),
    "norm": Card(
        "N_ij = ‖Σ_h α^h_ij f^h(x_j)‖ (Kobayashi et al. 2020); per head ‖α^h_ij f^h(x_j)‖.",
        TRACED + "; the norm engine checks that the vectors rebuild the real attention output.",
        "Gram matrices per head, no [H, n, n, d] tensor; output [L, n, n] (per head [L, H, n, n]); requested rows only "
        "with --rows.",
    ),
    "norm_res": Card(
        "N-Res_ij = ‖t_ij‖, attention plus residual (Kobayashi et al. 2021).",
        TRACED + "; the norm engine checks its decomposition.",
        "[L, n, n]; requested rows only with --rows.",
    ),
    "norm_resln": Card(
        "N-ResLN_ij = ‖g_i(t_ij)‖, attention, residual and LayerNorm as the linear map g_i at target i (Kobayashi et "
        "al. 2021).",
        TRACED + "; the norm engine checks its decomposition.",
        "[L, n, n]; requested rows only with --rows.",
    ),
    "attention_rollout": Card(
        "R_l = Â_l R_{l−1}, Â = rows-normalised 0.5·mean_h α^h + 0.5·I (Abnar & Zuidema 2020); layer l in terms of "
        "the input tokens.",
        TRACED + ".",
        ROLLOUT_MEMORY + ".",
    ),
    "attention_flow": Card(
        "Entry (i, j) of layer l = max-flow from input token j to node (l, i) over the layered graph with capacities "
        "Â_l[i, j], rows normalised (Abnar & Zuidema 2020).",
        TRACED + ", then n² max-flows per layer (scipy); limited to 32 tokens.",
        "[L, n, n]; no row mode.",
    ),
    "alti": Card(
        "c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁), rows normalised; T_i(x_j) = g_i(t_ij), y_i the real LN1 output "
        "(pre-LN: t_ij and the residual sum) (Ferrando et al. 2022).",
        TRACED + ".",
        "[L, n, n]; with --rows only the requested rows ([L, t, n]); T_i(x_j) built in 4 MB chunks of target rows "
        "(CPU: only the sign-risky coordinates).",
    ),
    "alti_rollout": Card(
        "R_l = C_l R_{l−1}, the product of the per-layer ALTI matrices over layers 1..l.",
        TRACED + ".",
        ROLLOUT_MEMORY + ".",
    ),
    "logit_attn": Card(
        "score_j = Σ_l Δ^l_j, Δ^l_j = Σ_h α^h_pj (v^h_j W_O^h)·u: each layer's attention update at the target position "
        "p split per source, on the logit direction u = C(γ_f ⊙ w)/s_f, w = W_U[target] (− W_U[foil]) (Ferrando et al. "
        "2023, no carry-back); Σ_j score_j + remainder = the model's logit (checked).",
        TRACED + " (a causal LM's logit at the target position).",
        "[L, n] per-layer terms (extra), α read by rows (no [H, n, n] on a causal LM); output [n].",
        "mt-upc/logit-explanations (`src/contributions.py`, the authors' code)",
        "asserted < 1e-4 relative to the largest direct term; measured 3.6e-7 per layer, 2.7e-7 per head (GPT-2); "
        "≤ 3.4e-7 on OPT and BLOOM (pairwise eps 0)",
        ALTI_LOGIT_CHECK,
    ),
    "alti_logit": Card(
        "score_j = Σ_l (Δ^l C_{l−1} ⋯ C_0)_j: logit_attn's per-layer rows Δ^l carried back to the input tokens "
        "through the ALTI matrices C_k of the layers below (Ferrando et al. 2023); Σ_j score_j + remainder = the "
        "model's logit (checked).",
        TRACED + " (a causal LM's logit at the target position).",
        "[L, n] per-layer terms (extra) plus one layer's ALTI matrix [n, n] at a time for the carry-back (built "
        "in blocks of 256 rows); α read by rows; output [n].",
        "mt-upc/logit-explanations (`contributions.py` run unchanged; its normalisation, rollout and carry-back "
        "restated in the test)",
        "asserted < 1e-4 relative to the largest direct term; measured 6.9e-5 with the authors' pairwise eps, 1.0e-6 "
        "per layer with it set to 0 (GPT-2); ≤ 9.1e-7 on OPT and BLOOM (pairwise eps 0)",
        ALTI_LOGIT_CHECK,
    ),
    "saliency": Card(
        "s_j = reduce_d ∂g/∂e_j (reduction l2 ‖·‖₂, l1 ‖·‖₁ or sum, the signed sum).",
        "One forward and one backward pass of its own per batch (LM head at the target position only).",
        "Every layer's input (layers · n · d floats) and one layer's activations at a time (each layer is "
        "recomputed in the backward); output [n].",
        "captum `Saliency(abs=False)`",
        "asserted atol 1e-5, rtol 1e-3 (a benchmark, not a unit test)",
        "benchmarks/bench_gradients_vs_captum.py",
    ),
    "grad_x_input": Card(
        "s_j = reduce_d (∂g/∂e_j ⊙ e_j) (reduction l2, l1 or sum).",
        "One forward and one backward pass of its own per batch (LM head at the target position only).",
        "Every layer's input (layers · n · d floats) and one layer's activations at a time (each layer is "
        "recomputed in the backward); output [n].",
        "inseq `input_x_gradient` (whole answers, SmolLM2-135M-Instruct; reduction sum = its `sum`, l2 = its "
        "`vnorm`); captum `InputXGradient`",
        "inseq: asserted ≤ 1e-5 of the largest |value| (measured 3.4e-6 signed sum, 4.2e-6 L2); captum: asserted "
        "atol 1e-5, rtol 1e-3",
        "tests/explain/test_answers_vs_inseq.py::test_single_token_gradient_x_input_equals_inseq and "
        "::test_answer_gradient_x_input_equals_inseq (skipped unless MIXLENS_INSEQ_PYTHON names a Python with inseq); "
        "benchmarks/bench_gradients_vs_captum.py (captum)",
    ),
    "integrated_gradients": Card(
        "IG_j = reduce_d (e_j − b_j) ⊙ (1/m) Σ_k ∂g/∂e_j at b + (k/m)(e − b), m = steps, baseline b zero or [PAD] "
        "embeddings (captum's Gauss-Legendre points); extra delta = Σ_j IG_j − (g(e) − g(b)).",
        "steps forward + backward passes (in chunks of internal_batch_size rows), plus forwards at the input and "
        "the baseline.",
        "Every layer's input and one layer's activations of one chunk (about 2048 tokens by default; each layer "
        "is recomputed in the backward); output [n].",
        "captum `IntegratedGradients` (mixlens runs it; compared on f(e) = the full-logit model's target logit)",
        "torch.testing.assert_close float32 defaults (rtol 1.3e-6, atol 1e-5); delta atol 1e-5",
        "tests/methods/test_saliency.py::test_lm_logits_only_at_target",
    ),
    "attnlrp": Card(
        "R_j = Σ_d e_j ⊙ ∂̃g/∂e_j, the gradient modified by the AttnLRP rules (Achtibat et al. 2024: softmax, q·k "
        "and gates as in the paper; variant cp holds attention weights and gates constant); Σ_j R_j ≈ g "
        "(conservation extra).",
        "One forward and one modified backward pass of its own per batch, plus one more forward of the layers "
        "(each layer recomputed in the backward).",
        "Every layer's input (L·n·d) plus one layer's activations at a time; no [H, n, n] α kept (fused attention "
        "kernels; Gemma 2 and MPNet stay eager); output [n].",
        "lxt 2.1 (the authors' package; `attnlrp` and `cp_LRP` on random GPT-2, Llama and Gemma 3)",
        "asserted atol 1e-6·max|R| + 1e-7; measured largest difference 1.1e-7 (relevances up to 0.55)",
        "tests/methods/test_attnlrp.py::test_equals_lxt (skipped unless MIXLENS_LXT_PYTHON names a Python with lxt "
        "and transformers < 5)",
    ),
    "decompx": Card(
        "‖x^l_{i⇐k}‖: every hidden state is a sum of parts x_i = Σ_k x_{i⇐k} carried through attention, residuals, "
        "norms and the FFN (activation linearised at the real pre-activation, biases shared by AbsDot) (Modarressi "
        "et al. 2023).",
        "One traced forward pass with the FFN captured, no backward.",
        "Parts [n, n, d] per layer in 64 MB chunks of target rows; output [L, n, n]; no row mode.",
        "mohsenfayyaz/DecompX (`src/modeling_bert.py`, transcribed outside the repository)",
        "measured 1.2e-6 relative (per-layer norms, 272 SST-2 sentences, value_bias=values)",
        "an uncommitted transcription of the official code, run by the command in global.md; no test in the "
        "repository runs it (the official default convention is tested by "
        "tests/methods/test_decompx.py::test_default_value_bias_is_the_official_one)",
    ),
    "decompx_classes": Card(
        "Score_{c,k} = the part of logit c from token k: the DecompX parts carried through the classification head "
        "(pooler / head activations linearised); Σ_k score_{c,k} = logit c (checked, ≤ 1e-3 relative).",
        "One traced forward pass with the FFN captured, no backward.",
        "Parts [n, n, d] per layer in 64 MB chunks of target rows; output [C, n].",
        "mohsenfayyaz/DecompX (`src/modeling_bert.py`, transcribed outside the repository)",
        "measured 2.0e-6 relative (class scores, 272 SST-2 sentences, value_bias=values)",
        "an uncommitted transcription of the official code, run by the command in global.md; no test in the "
        "repository runs it (the official default convention is tested by "
        "tests/methods/test_decompx.py::test_default_value_bias_is_the_official_one)",
    ),
    "decompx_logit": Card(
        "score_k = h_{⇐k} · (W_U[target] − W_U[foil]): the DecompX parts of the final hidden state at a causal LM's "
        "target position through the unembedding (head bias shared by AbsDot); Σ_k score_k = the logit (checked).",
        "One traced forward pass with the FFN captured, no backward.",
        "Parts [n, n, d] per layer in chunks of target rows; output [n].",
        note="the official DecompX code covers BERT-style classifiers only",
    ),
    "flow_routes": Card(
        "Edge importance = max(ε, ‖y‖₁ − ‖e − y + δ‖₁) / Σ_k max(ε, ‖y‖₁ − ‖e_k − y + δ‖₁) for each edge vector e of "
        "node y (per head and source, residual, FFN), kept above τ top-down from the prediction (Ferrando & Voita "
        "2024).",
        TRACED + " (keeping only the FFN output).",
        "α read by rows; output [L, n, n] (per head [L, H, n, n]).",
        "facebookresearch/llm-transparency-tool (`routes/contributions.py`, `routes/graph.py`, run unchanged)",
        "raw shares: measured 5.5e-6, asserted 1e-5; pruned graphs (τ 0.04 and 0.1): the same edges, weights to "
        "1e-5; live: atol 1e-5, rtol 1e-4",
        FLOW_CHECK,
    ),
    "flow_routes_tokens": Card(
        "Score_j = the total importance of the kept routes from input token j to the explained prediction in the "
        "flow_routes graph.",
        TRACED + " (keeping only the FFN output).",
        "α read by rows; output [n].",
        note="the authors' tool gives no per-token score; the graph it sums is flow_routes', compared with the tool",
    ),
    "globenc": Card(
        "N-Enc_ij = ‖g2_i(g1_i(t_ij))‖, LN1 then LN2 as linear maps at target i (Modarressi et al. 2022); pre-LN "
        "models: ‖t_ij‖.",
        "One traced forward pass with the FFN captured, no backward; every call checks that the decomposition "
        "rebuilds the real layer output.",
        "[L, n, n]; with --rows only the requested rows ([L, t, n]).",
        note="the unnormalised scale follows the official code's, but no values were compared",
    ),
    "globenc_rollout": Card(
        "R_l = N_l R_{l−1}, the plain product of the N-Enc matrices (normalize=true: each layer's rows scaled to 1 "
        "first).",
        "One traced forward pass with the FFN captured, no backward.",
        ROLLOUT_MEMORY + "; a layer is divided by a power of two only where it leaves [2⁻⁶⁴, 2⁶⁴].",
    ),
    "hta": Card(
        "HTA_ij = ‖∂e^l_i/∂x_j‖_F, rows normalised (Brunner et al. 2020), by forward-mode Jacobian-vector products; "
        "mode estimate: Hutchinson probes, with standard errors.",
        "exact: n·d_in JVPs (each about one forward); estimate: n·probes JVPs.",
        "[L, n, n]; no row mode.",
        note="checked against mixlens' own reverse-mode loop instead: relative 9.8e-7 on ‖J‖²_F "
        "(benchmarks/bench_hta.py)",
    ),
    "head_attribution": Card(
        "A^{l,h}_ij = ‖∂o^{l,h}_i/∂x_j‖_F, rows normalised (Pascual et al. 2021), by forward-mode JVPs.",
        "exact: n·d_in JVPs (each about one forward); estimate: n·probes JVPs.",
        "[L, H, n, n]; no row mode.",
    ),
    "norm_rollout": Card(
        "R_l = N_l R_{l−1}, N = ‖Σ_h α^h_ij f^h(x_j)‖ (plain product, no residual).",
        TRACED + " (norm engine).",
        "[L, n, n]; no row mode.",
    ),
    "norm_res_rollout": Card(
        "R_l = N_l R_{l−1}, N = N-Res = ‖t_ij‖ (plain product).",
        TRACED + " (norm engine).",
        "[L, n, n]; no row mode.",
    ),
    "norm_resln_rollout": Card(
        "R_l = N_l R_{l−1}, N = N-ResLN = ‖g_i(t_ij)‖ (plain product).",
        TRACED + " (norm engine).",
        "[L, n, n]; no row mode.",
    ),
    "occlusion": Card(
        "s_j = g(e) − g(e with e_j = 0), one token at a time (captum `Occlusion`, window one token, run by mixlens).",
        "n + 1 forward passes per input, no backward, in chunks of at most 4096 tokens.",
        "One chunk's forward activations; output [n].",
        note="captum's `Occlusion` computes it (mixlens supplies the scalar and the chunks); not compared separately",
    ),
    "deeplift": Card(
        "DeepLIFT-rescale (captum `DeepLift`, run by mixlens) from zero word embeddings, summed over hidden dims; "
        "the rule applies at the modules captum knows, the gradient elsewhere.",
        "One forward (input and baseline) and one backward pass per batch.",
        "The activations of one backward pass; output [n].",
        note="captum's `DeepLift` computes it; not compared separately",
    ),
    "gradient_shap": Card(
        "Expected gradients (captum `GradientShap`, run by mixlens) from the zero and the pad/mask-token embeddings, "
        "samples seeded draws.",
        "samples forward + backward passes, in chunks.",
        "One chunk's activations; output [n].",
        note="captum's `GradientShap` computes it, in chunks of samples; not compared separately",
    ),
    "lime": Card(
        "Weighted ridge fit (λ = 1) of g on samples seeded token subsets, exponential kernel on cosine distance "
        "(captum `Lime`, run by mixlens, one input at a time).",
        "samples forward passes per input, no backward, in chunks.",
        "Every sample's subset and output ([samples, n]); output [n].",
        note="captum's `Lime` computes it (mixlens supplies the closed-form ridge); not compared separately",
    ),
    "value_zeroing": Card(
        "VZ_ij = cosine distance between layer l's output at i and the same with value vector j zeroed in every "
        "head, rows normalised (Mohebbi et al. 2023).",
        "One traced forward pass, then n single-layer passes per layer (stacked, at most 8192 tokens a call); no "
        "backward.",
        "[L, n, n]; no row mode.",
    ),
    "value_zeroing_rollout": Card(
        "R_l = VZ_l R_{l−1}, the product of the per-layer value-zeroing matrices.",
        "As value_zeroing: one traced forward pass and n single-layer passes per layer.",
        "[L, n, n]; no row mode.",
    ),
    "value_zeroing_logit": Card(
        "s_j = g(x) − g(x with token j's value vectors zeroed in every layer).",
        "n forward passes per input (token j's values zeroed), plus the unedited one (shared when traced); no "
        "backward.",
        "The n zeroed copies stacked on the batch axis, at most 8192 tokens a call; output [n].",
    ),
}
