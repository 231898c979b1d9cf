"""What one training micro-batch holds on its device beyond the weights, their gradients and the optimizer.

One count serves every check: ``longqa train``'s plan (``planner.py``) and ``longqa sft``'s both call
``activation_bytes``, and ``benchmarks/memory_check.py`` sets it beside the peaks it measures. It is meant
to be an upper bound that is not far above: a check that lets a run through which then dies of
out-of-memory costs the run, one that refuses too much costs only a smaller micro-batch. Its parts:

- each kept decoder layer's saved tensors, per token (``layer_bytes_per_token``). Compiled layers keep the
  fourteen 16-bit widths of ``saved_activation_widths`` and a few float32 per-head values, as listed on an
  H200; eager layers keep what the Llama-family modeling code (Llama, Qwen2, Qwen3, Mistral) hands autograd,
  counted from that code (``eager_layer_bytes``): RMSNorm computes in float32 and keeps its float32 input and
  its normalised tensor, the projections keep their inputs, attention its rotated queries and keys, values,
  output and log-sum-exp, the MLP its gate, activation, up projection and their product (``mlp_bytes``; a
  tiled MLP, ``model.mlp_tile_tokens``, keeps none of them, and holds one tile's again, with their gradients,
  while its backward pass crosses it). Under autocast
  (``longqa sft`` on a GPU) the weights and the residual stream stay float32 and every projection keeps its
  own bfloat16 copy of its input;
- attention masks: a boolean mask handed to SDPA (the dense packed backend, one per pack; a padded batch's in
  the naive layout) is turned into an additive mask in the queries' dtype, a new one in
  every layer, which the kernel keeps for its backward pass: ``L x L`` per pack and layer, the last dimension
  rounded up to 16 as the CUDA kernels pad it (``mask_bytes``). Quadratic in the pack's length, it is what
  long prompts on the dense backend run out of; where SDPA can only use its math kernel (float32 with grouped
  key/value heads on CUDA), its attention probabilities too, ``heads`` times that (``score_bytes``);
- recomputed layers keep their input alone, and one of them holds its whole activations again while its
  backward pass runs; layers offloaded to host memory keep nothing on the device;
- the LM head (``model/logprobs.py``): the final norm's tensors, the hidden states of the predicted tokens, and
  during one chunk's backward pass ``HEAD_CHUNK_TENSORS`` float32 ``[chunk, vocab]`` tensors (the recomputed
  logits and their softmax, the gradients of the log-sum-exp and of the entropy) plus the gradient of the
  head's ``[vocab, hidden]`` weight. The chunk bounds it: without chunks a 131,072-token batch of a
  49,152-entry vocabulary holds 25.8 GB of float32 logits, several times over;
- per token, the ids, positions, targets, log-probs and loss terms of the batch (``BOOKKEEPING_BYTES``), the
  rotary tables, and under autocast the bfloat16 copy of every decoder weight;
- the backward pass's own gradients while it crosses one layer (``layer_gradient_bytes``), or the LM head's, or
  the embedding's at the end (``embedding_gradient_bytes``), whichever is largest.

Under Ulysses sequence parallelism (``actor.sequence_parallel_size`` = sp) each rank of a group of sp holds 1/sp
of the packed row for everything per token (the norms, the MLP, the projections, the LM head, the bookkeeping),
but attention runs over the whole row for heads/sp of the heads: the all-to-all before it trades sequence
shards for head shards, and the one after it trades them back. So what the attention kernel keeps in its own
layout (rotated queries, keys, values, output and log-sum-exp, ``attention_layout_bytes``) is counted for the
whole row at heads/sp; key/value heads fewer than sp are repeated to one a rank, which then holds more than
1/sp of them. A layer's attention backward pass holds the gradients of those tensors in the kernel's layout
and the all-to-alls' sequence-layout buffers on either side (``all_to_all_bytes``).

The peak is the largest of the backward pass's moments: the LM head's chunk (every saved tensor still held),
a kept layer's, a recomputed layer's (after the kept layers, the last ones, have freed theirs) and the
embedding's at the end (with next to nothing else left).
"""

from __future__ import annotations

from dataclasses import dataclass

LM_HEAD_CHUNK = 2048  # tokens per LM-head chunk (model/logprobs.py)
# [chunk, vocab] float32 tensors alive at once in a chunk's backward pass: the recomputed logits, their softmax
# (the entropy's) and the log-sum-exp's gradient, the entropy's and the log-prob's (the logits divided by a
# temperature replace the undivided ones). Measured on the CPU (benchmarks/memory_check.py), where nothing fuses.
HEAD_CHUNK_TENSORS = 5
# Per token of the micro-batch: int64 ids, positions, prediction positions and targets (32 bytes), int32 pack
# and segment ids (8), and float32 log-probs, entropies, old log-probs, advantages, masks and the loss terms of
# algo.policy_loss and their gradients (about 20 x 4); rounded up.
BOOKKEEPING_BYTES = 128
MASK_ALIGNMENT = 16  # CUDA's memory-efficient attention pads an additive mask's last dimension to this


@dataclass(frozen=True)
class Compute:
    """How a training forward computes: ``dtype_bytes`` is its activations' dtype (bfloat16 under autocast),
    ``param_bytes`` its weights' (and their gradients'), ``autocast`` float32 weights with bfloat16 matmuls
    and attention (``longqa sft`` on a GPU), ``compiled`` decoder layers compiled by ``torch.compile``."""

    dtype_bytes: int = 2
    param_bytes: int = 2
    autocast: bool = False
    compiled: bool = False
    cuda: bool = True  # SDPA picks its kernel by device, dtype and heads (score_bytes)
    mlp_tile: int = 0  # model.mlp_tile_tokens: eager layers' MLPs computed over tiles of this many tokens

    def mlp_tokens(self, tokens: int) -> int:
        """Tokens whose MLP intermediates exist at once in a row of ``tokens``: one tile where the MLP is tiled
        (model/tiled_mlp.py: a longer row than a tile, and eager layers, since compiled ones are untiled)."""
        return self.mlp_tile if self.mlp_tile and not self.compiled and tokens > self.mlp_tile else tokens

    @property
    def stream_bytes(self) -> int:
        """The residual stream's dtype: the weights' under autocast (float32), else the activations'."""
        return 4 if self.autocast else self.dtype_bytes


def saved_activation_widths(sizes) -> list[int]:
    """The widths of the 16-bit tensors a compiled decoder layer saves per token for its backward pass, as
    listed by a saved-tensors hook on one H200 (SmolLM2-135M's, Qwen3-0.6B's and Qwen3-1.7B's shapes under
    flex attention): three of the MLP's (gate, up, their product); four of the hidden size (the input, its
    norm, the residual after attention, the second norm); three of the queries' width and three of the
    keys' (rotated queries and keys, values, in the attention kernel's layout and flat, and attention's
    output); and one more of the wider of hidden and queries. That is exact for Qwen3-0.6B and 6% over the
    other two; the float32 per-head tensors are ``layer_float32_bytes``."""
    queries, keys = sizes.heads * sizes.head_dim, sizes.kv_heads * sizes.head_dim
    return [sizes.intermediate] * 3 + [sizes.hidden] * 4 + [queries] * 3 + [keys] * 3 + [max(sizes.hidden, queries)]


def layer_float32_bytes(sizes) -> int:
    """A compiled layer's float32 tensors per token: attention's log-sum-exp and a per-query-head and a
    per-key-head factor, and the two norms' reciprocal roots."""
    return 4 * (2 * sizes.heads + sizes.kv_heads + 2)


def rms_norm_bytes(width: int, input_bytes: int) -> int:
    """What an eager RMSNorm keeps per token: its input in float32 (the input itself, or its float32 copy), the
    normalised tensor cast back to the input's dtype (for the weight's gradient), and one float32 rsqrt."""
    return 4 * width + input_bytes * width + 4


def mlp_bytes(sizes, compute: Compute) -> int:
    """Bytes per token an eager MLP keeps for its backward pass: gate, its activation, up, their product."""
    return 4 * sizes.intermediate * compute.dtype_bytes


def eager_layer_bytes(sizes, compute: Compute, packed: bool = False, tiled_mlp: bool = False) -> int:
    """Bytes per token one eager Llama-family decoder layer keeps for its backward pass (the module docstring
    says what). ``packed``: longqa's packed attention hands ``o_proj`` a contiguous copy of attention's output,
    where transformers' kernels return it in that layout already. ``tiled_mlp``: its MLP keeps only its input,
    the norm's output counted already."""
    b, stream = compute.dtype_bytes, compute.stream_bytes
    hidden = sizes.hidden
    queries, keys = sizes.heads * sizes.head_dim, sizes.kv_heads * sizes.head_dim

    def norm_output(consumers: int) -> int:  # kept once in the layers' dtype, or by each projection as its own cast
        return hidden * (2 * consumers if compute.autocast else b)

    total = rms_norm_bytes(hidden, stream) + norm_output(3)  # input norm, read by q, k and v
    if sizes.qk_norm:  # per-head norms of q and k (Qwen3), one rsqrt per head
        total += rms_norm_bytes(queries, b) + rms_norm_bytes(keys, b) + 4 * (sizes.heads + sizes.kv_heads - 2)
    total += (queries + 2 * keys) * b  # attention's inputs: rotated queries and keys, values
    total += queries * b * (2 if packed else 1) + 4 * sizes.heads  # its output (and copy), its log-sum-exp
    total += rms_norm_bytes(hidden, stream) + norm_output(2)  # post-attention norm, read by gate and up
    return total + (0 if tiled_mlp else mlp_bytes(sizes, compute))


def layer_bytes_per_token(sizes, compute: Compute, packed: bool = False, tiled_mlp: bool = False) -> int:
    """Bytes per token one kept decoder layer saves for its backward pass, compiled or eager."""
    if compute.compiled:
        return compute.dtype_bytes * sum(saved_activation_widths(sizes)) + layer_float32_bytes(sizes)
    return eager_layer_bytes(sizes, compute, packed, tiled_mlp)


def heads_per_rank(sizes, sequence_parallel: int) -> tuple[int, int]:
    """``(query heads, key/value heads)`` one rank attends over the whole row with ``sequence_parallel`` ranks a
    row: heads/sp of each, key/value heads fewer than sp repeated so that each rank holds one."""
    return -(-sizes.heads // sequence_parallel), -(-sizes.kv_heads // sequence_parallel)


def attention_layout_bytes(sizes, compute: Compute, sequence_parallel: int = 1) -> int:
    """Bytes per token of the whole row that one rank's attention kernel keeps in its own layout for the
    backward pass: its rotated queries and keys, values and output in the activations' dtype, its float32
    log-sum-exp, over the heads the rank attends (``heads_per_rank``). Eager and compiled layers both keep
    these; the rest of ``layer_bytes_per_token`` is in the sequence layout, split over the ranks."""
    queries, kv = heads_per_rank(sizes, sequence_parallel)
    return compute.dtype_bytes * sizes.head_dim * (2 * queries + 2 * kv) + 4 * queries


def local_tokens(tokens: int, sequence_parallel: int) -> int:
    """One rank's share of a row of ``tokens`` split over ``sequence_parallel`` ranks (the longest share)."""
    return -(-tokens // sequence_parallel)


def layer_bytes(
    sizes, compute: Compute, tokens: int, packed: bool = False, sequence_parallel: int = 1, tiled_mlp: bool = False
) -> int:
    """Bytes one rank's kept decoder layer saves over a row of ``tokens`` split over ``sequence_parallel`` ranks:
    the sequence-layout tensors of its share of the row, and attention's own over the whole row at heads/sp.
    ``tiled_mlp``: its MLP keeps only its input (``eager_layer_bytes``)."""
    per_token = layer_bytes_per_token(sizes, compute, packed, tiled_mlp)
    if sequence_parallel == 1:
        return tokens * per_token
    sequence_layout = per_token - attention_layout_bytes(sizes, compute)
    return local_tokens(tokens, sequence_parallel) * sequence_layout + tokens * attention_layout_bytes(
        sizes, compute, sequence_parallel
    )


def all_to_all_bytes(sizes, compute: Compute, tokens: int, sequence_parallel: int) -> int:
    """What one layer's attention backward pass holds on a rank under sequence parallelism, beyond the saved
    tensors: the gradients of the output, queries, keys and values in the kernel's layout (the whole row, the
    rank's heads), and in the sequence layout the output's gradient that the all-to-all brought in and the
    queries', keys' and values' that it sends back (the rank's share of the row, every head). None without."""
    if sequence_parallel == 1:
        return 0
    queries, kv = heads_per_rank(sizes, sequence_parallel)
    kernel = tokens * sizes.head_dim * (2 * queries + 2 * kv)
    local = local_tokens(tokens, sequence_parallel) * sizes.head_dim * (2 * sizes.heads + 2 * sizes.kv_heads)
    return compute.dtype_bytes * (kernel + local)


def mask_bytes(tokens: int, span: int, compute: Compute) -> int:
    """One layer's additive attention masks over a row of ``tokens`` tokens cut into attended blocks (packs, or
    padded rows) of at most ``span`` tokens: the sum of their squares is at most ``tokens x span``. In the
    queries' dtype, the last dimension padded as the CUDA kernels pad it; 0 where no mask is handed to SDPA."""
    if not span:
        return 0
    return tokens * (-(-span // MASK_ALIGNMENT) * MASK_ALIGNMENT) * compute.dtype_bytes


def score_bytes(sizes, tokens: int, span: int, compute: Compute, sequence_parallel: int = 1) -> int:
    """One layer's attention probabilities, where SDPA can only run its math kernel, which materialises them
    (``heads x L x L`` per block of ``L`` tokens, at most ``heads x tokens x span``) and keeps them for the
    backward pass. On CUDA that is float32 queries under a mask with grouped key/value heads: FlashAttention and
    cuDNN take 16-bit inputs only, and the memory-efficient kernel no grouped heads. Measured on an H200: a
    float32 SmolLM2-135M pack of 11,264 tokens on the dense backend asked for 4.25 GiB (9 x 11,264^2 x 4 bytes)
    in each of its 30 layers and ran out of memory. On the CPU, SDPA's flash kernel keeps no scores. Under
    sequence parallelism a rank's attention covers the whole row for its heads (``heads_per_rank``)."""
    grouped = sizes.kv_heads != sizes.heads
    if not (compute.cuda and span and compute.dtype_bytes == 4 and grouped):
        return 0
    return heads_per_rank(sizes, sequence_parallel)[0] * tokens * span * compute.dtype_bytes


def layer_gradient_bytes(sizes, tokens: int, mlp_tokens: int | None = None) -> int:
    """The gradients alive while the backward pass crosses one layer: the residual stream's and its branch's
    (two of the hidden size) and the MLP's three (gate, up, their product) over ``mlp_tokens`` (a tiled MLP's
    tile; default the row), float32 at most."""
    mlp_tokens = tokens if mlp_tokens is None else mlp_tokens
    return 4 * (2 * sizes.hidden * tokens + 3 * sizes.intermediate * mlp_tokens)


def head_bytes(sizes, compute: Compute, tokens: int, head_tokens: int) -> tuple[int, int]:
    """``(kept, transient)`` bytes of the final norm and the chunked LM head (``model/logprobs.py``): kept through
    the backward pass, the final norm's tensors over the row and the hidden states gathered at the ``head_tokens``
    predicted tokens; transient, one chunk's float32 ``[chunk, vocab]`` tensors during its backward pass (and its
    logits in the activations' dtype before their float32 copy), with the gradient of the head's weight: this
    chunk's, and past the first chunk also the sum of those before, which autograd holds until the last one's is
    in. Under autocast the chunk also casts the weight to bfloat16 and gets that copy's gradient first."""
    stream = compute.stream_bytes
    kept = tokens * (rms_norm_bytes(sizes.hidden, stream) + stream * sizes.hidden)
    kept += head_tokens * sizes.hidden * stream
    chunk = min(head_tokens, LM_HEAD_CHUNK)
    per_row = 4 * HEAD_CHUNK_TENSORS
    if compute.dtype_bytes < 4:
        per_row += compute.dtype_bytes
    weight = sizes.vocab * sizes.hidden
    copies = compute.param_bytes * (2 if head_tokens > chunk else 1) + (4 if compute.autocast else 0)
    return kept, chunk * sizes.vocab * per_row + weight * copies


def embedding_gradient_bytes(sizes, compute: Compute) -> tuple[int, int]:
    """``(held, transient)``: with tied embeddings autograd holds the LM head's whole weight gradient until the
    embedding's arrives, at the end of the backward pass, which then makes a dense ``[vocab, hidden]`` gradient
    and their sum; an untied embedding's gradient alone."""
    weight = sizes.vocab * sizes.hidden * compute.param_bytes
    return (weight, 3 * weight) if sizes.tied else (0, weight)


@dataclass
class Activations:
    """Bytes of one micro-batch by what holds them; ``total`` is the peak the checks count."""

    layers: int  # kept layers' saved tensors, recomputed layers' inputs
    masks: int  # kept layers' additive attention masks, and the math kernel's scores where it runs (score_bytes)
    head: int  # the final norm and the gathered hidden states, kept through the backward pass
    other: int  # rotary tables and the batch's per-token bookkeeping
    transient: int  # the peak's excess over the rest: the backward pass's largest moment (``activation_bytes``)

    @property
    def total(self) -> int:
        return self.layers + self.masks + self.head + self.other + self.transient


def activation_bytes(
    sizes,
    compute: Compute,
    tokens: int,
    *,
    recomputed: float = 0.0,
    offloaded: float = 0.0,
    mask_span: int = 0,
    packed: bool = False,
    head_tokens: int | None = None,
    sequence_parallel: int = 1,
) -> Activations:
    """Peak bytes of one forward and backward pass over a row of ``tokens`` tokens (the module docstring says
    what is counted). ``recomputed`` and ``offloaded``: the fractions of decoder layers recomputed in the backward
    pass and kept in host memory; ``mask_span``: the longest block a boolean attention mask covers (0: no mask);
    ``packed``: longqa's packed attention; ``head_tokens``: tokens the LM head predicts (default all);
    ``sequence_parallel``: the ranks the row is split over (one rank's bytes are counted)."""
    sp = sequence_parallel
    head_tokens = tokens if head_tokens is None else head_tokens
    local = local_tokens(tokens, sp)  # the rank's share of the row: everything per token but attention
    recomputed_layers = round(float(recomputed) * sizes.layers)
    kept = sizes.layers - recomputed_layers - round(offloaded * sizes.layers)
    mlp_tokens = compute.mlp_tokens(local)  # the MLP runs on the rank's share: one tile of it at once when tiled
    tiled = mlp_tokens < local  # a tiled MLP: one tile's intermediates again while its backward pass crosses it
    per_layer = layer_bytes(sizes, compute, tokens, packed, sp, tiled)
    per_mask = mask_bytes(tokens, mask_span, compute) + score_bytes(sizes, tokens, mask_span, compute, sp)
    scores_transient = 2 * score_bytes(sizes, tokens, mask_span, compute, sp)  # the scores and their gradient
    head_kept, head_transient = head_bytes(sizes, compute, local, local_tokens(head_tokens, sp))
    held, embedding_transient = embedding_gradient_bytes(sizes, compute)
    other = local * (2 * sizes.head_dim * compute.stream_bytes + BOOKKEEPING_BYTES)
    if compute.autocast:  # each decoder weight's bfloat16 copy, made once by autocast and kept for the backward pass
        other += 2 * sizes.layers * sizes.layer_params
    kept_layers, kept_masks = kept * per_layer, kept * per_mask
    saved = kept_layers + kept_masks + recomputed_layers * local * sizes.hidden * compute.stream_bytes
    saved += head_kept + other
    # a layer's backward pass: its MLP's gradients, or (sequence parallel) its attention's and the all-to-alls'
    attention = 4 * local * 2 * sizes.hidden + all_to_all_bytes(sizes, compute, tokens, sp)
    gradients = held + max(layer_gradient_bytes(sizes, local, mlp_tokens), attention) + scores_transient
    if tiled:
        gradients += mlp_tokens * mlp_bytes(sizes, compute)
    moments = [
        saved + head_transient,  # the LM head's backward pass comes first
        saved + gradients,  # a kept layer's (the kept layers are the last ones: theirs come next)
        other + embedding_transient + 4 * local * sizes.hidden,
    ]  # the embedding's, at the end
    if recomputed_layers:  # a recomputed layer's, the kept layers' tensors freed: it holds its own again
        moments.append(saved - kept_layers - kept_masks + gradients + per_layer + per_mask)
    return Activations(
        layers=saved - kept_masks - head_kept - other,
        masks=kept_masks,
        head=head_kept,
        other=other,
        transient=max(moments) - saved,
    )


def update_activations(
    sizes,
    compute: Compute,
    *,
    budget: int,
    prompt_length: int,
    response_length: int,
    n: int,
    backend: str,
    recomputed: float = 0.0,
    offloaded: float = 0.0,
    shared_prompt: bool = True,
    head_tokens: int | None = None,
    sequence_parallel: int = 1,
) -> Activations:
    """One micro-batch of the GRPO update (``train/actor.py``) at ``actor.max_tokens_per_micro_batch`` =
    ``budget``: a sample longer than the budget goes alone, the flex and split backends pad the packed row to
    their length step, and the dense backend masks each pack (a prompt and up to ``n`` responses, cut to the
    budget). The naive layout (``shared_prompt=False``) pads rows of one sample each, masked by transformers.
    ``head_tokens``: the response tokens the LM head predicts, where known (at most the row);
    ``sequence_parallel``: the ranks each packed row is split over (``actor.sequence_parallel_size``; the budget is
    the whole row's)."""
    from longqa.model.attention import PADDED_BACKENDS, length_step

    sample = prompt_length + response_length
    tokens = max(budget, sample)
    if not shared_prompt:
        return activation_bytes(
            sizes,
            compute,
            tokens,
            recomputed=recomputed,
            offloaded=offloaded,
            mask_span=sample,
            head_tokens=head_tokens,
            sequence_parallel=sequence_parallel,
        )
    if backend in PADDED_BACKENDS:
        step = length_step(budget)
        tokens = -(-tokens // step) * step
    span = min(prompt_length + n * response_length, tokens) if backend == "dense" else 0
    return activation_bytes(
        sizes,
        compute,
        tokens,
        recomputed=recomputed,
        offloaded=offloaded,
        mask_span=span,
        packed=True,
        head_tokens=head_tokens,
        sequence_parallel=sequence_parallel,
    )


def sft_activations(
    sizes, compute: Compute, *, batch_tokens: int, longest: int, head_tokens: int | None = None
) -> Activations:
    """One batch of ``longqa sft``: right-padded rows of at most ``batch_tokens`` tokens in all (an example longer
    than that alone), every layer kept, no attention mask (``sft_loss``), the chunked LM head over the
    ``head_tokens`` response tokens, where known (at most the batch)."""
    return activation_bytes(sizes, compute, max(batch_tokens, longest), head_tokens=head_tokens)
