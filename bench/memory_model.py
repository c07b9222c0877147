"""The memory and throughput model on paper (issue #39, item 4), from the engines' own accounting.

One place holds the model; ``bench/gpu_check.py`` compares its predictions with what a device measures, and
``python bench/memory_model.py`` prints the table of ``docs/benchmarks.md`` (Qwen2 0.5B / 1.5B / 7B shapes).

What the engines hold, per trainer rank (P parameters, N ranks, AdamW):
- ``actor.engine=torch`` keeps weights, gradients and both Adam moments in the model's dtype (torch's AdamW
  keeps its state in the parameter's dtype): 16 B/param in fp32, 8 in bf16; N ranks each hold all of it.
- ``actor.engine=deepspeed`` in bf16 keeps bf16 weights and gradients and an fp32 master copy with fp32 moments:
  2 + 2 + 12 at ZeRO-0, 4 + 12/N at ZeRO-1, 2 + 14/N at ZeRO-2, 16/N at ZeRO-3.
- Activations of one micro-batch, per layer and token: 34 x hidden bytes in a 16-bit dtype with a fused attention
  kernel (Korthikanti et al. 2022, without the 5·a·s/h term that SDPA's kernels do not store); the response's
  logits go through five fp32 ``[tokens, V]`` tensors in ``engines/training/forward.response_log_probs`` (the upcast, the
  division by the temperature, the log-softmax, and for the logged entropy its probabilities and their product):
  per response token V x (dtype + 5 x 4) bytes. (Counting three of them under-predicted the H200's peak by 27 %.)
  Chunked (``actor.logits_chunk_tokens``, engines/training/lm_head.py): one chunk's V x (dtype + 4 x 4) bytes.
- Generation (HF engine): the weights, the KV cache (2 x layers x kv_heads x head_dim x dtype bytes per token,
  prompt and response) and one step's fp32 logits and log-softmax (B x V x 12 bytes).
Throughput: an update costs 6 x P_matmul + 6 x layers x hidden x S FLOPs per token (causal attention, forward
and backward, S the sequence length); decoding is bound by reading the weights and the KV cache once a step.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = h * h + h + 2 * (h * kv + kv) + h * h  # q (bias), k and v (bias), o: Qwen2's projections
        return attn + 3 * h * self.intermediate + 2 * h  # gate, up, down; two RMSNorms

    def params(self) -> int:
        head = 0 if self.tied else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * self.layer_params() + self.hidden + head

    def matmul_params(self) -> int:
        """Parameters that take part in a matrix product per token (the embedding lookup does not; a tied
        embedding does as the output layer)."""
        return self.params() - (0 if self.tied else self.vocab * self.hidden)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def with_layers(self, layers: int) -> Shape:
        return Shape(
            self.name,
            self.hidden,
            layers,
            self.heads,
            self.kv_heads,
            self.intermediate,
            self.vocab,
            self.tied,
        )


# Qwen2's published shapes (config.json of Qwen/Qwen2-0.5B, -1.5B, -7B).
SHAPES = {
    "qwen2-0.5b": Shape("qwen2-0.5b", 896, 24, 14, 2, 4864, 151936, True),
    "qwen2-1.5b": Shape("qwen2-1.5b", 1536, 28, 12, 2, 8960, 151936, True),
    "qwen2-7b": Shape("qwen2-7b", 3584, 28, 28, 4, 18944, 152064, False),
}


def state_bytes_per_param(engine: str, dtype_bytes: int, zero_stage: int = 0, ranks: int = 1) -> float:
    """Weights + gradients + AdamW state held by one trainer rank, per parameter."""
    if engine == "torch":
        return 4 * dtype_bytes
    if dtype_bytes == 4:  # fp32 DeepSpeed: no master copy
        w, g, o = 4, 4, 8
    else:
        w, g, o = 2, 2, 12
    n = ranks
    return {0: w + g + o, 1: w + g + o / n, 2: w + (g + o) / n, 3: (w + g + o) / n}[zero_stage]


def activation_bytes(
    shape: Shape, tokens: int, response_tokens: int, dtype_bytes: int, chunk_tokens: int | None = None
) -> int:
    """One micro-batch's activations kept for the backward: the layers' and the response logits'. With chunked
    log-probs (``actor.logits_chunk_tokens``) over more response tokens than a chunk, the logits of one chunk live
    at a time: its logits in the model's dtype and four fp32 ``[chunk, V]`` tensors (the upcast, the log-softmax,
    its probabilities and, in the backward, the logits' gradient), and the response's last hidden states stay."""
    layers = shape.layers * 34 * shape.hidden * tokens * dtype_bytes // 2
    if chunk_tokens is not None and response_tokens > chunk_tokens:
        return layers + chunk_tokens * shape.vocab * (dtype_bytes + 16) + response_tokens * shape.hidden * dtype_bytes
    logits = response_tokens * shape.vocab * (dtype_bytes + 20)
    return layers + logits


def update_peak_bytes(
    shape: Shape, dtype_bytes: int, micro_samples: int, seq_len: int, response_len: int, engine: str = "torch",
    zero_stage: int = 0, ranks: int = 1,
) -> int:  # fmt: skip
    state = state_bytes_per_param(engine, dtype_bytes, zero_stage, ranks) * shape.params()
    return int(
        state + activation_bytes(shape, micro_samples * seq_len, micro_samples * response_len, dtype_bytes)
    )


def generate_peak_bytes(
    shape: Shape, dtype_bytes: int, batch: int, prompt_len: int, response_len: int
) -> int:
    kv = shape.kv_bytes_per_token(dtype_bytes) * batch * (prompt_len + response_len)
    return shape.params() * dtype_bytes + kv + batch * shape.vocab * 12


def update_flops_per_token(shape: Shape, seq_len: int) -> float:
    return 6 * shape.matmul_params() + 6 * shape.layers * shape.hidden * seq_len


def decode_tokens_per_s_bound(
    shape: Shape, dtype_bytes: int, batch: int, context: int, bytes_per_s: float
) -> float:
    """Decoding reads every weight and the batch's KV cache once a step: at most this many tokens a second."""
    step_bytes = shape.params() * dtype_bytes + shape.kv_bytes_per_token(dtype_bytes) * batch * context
    return batch * bytes_per_s / step_bytes


def table(
    card_gib: float = 80.0, bf16_tflops: float = 790.0, mfu: float = 0.4, bytes_per_s: float = 3.0e12
) -> str:
    """The docs' table: per shape, what one rank holds and what it may reach on one card."""
    rows = [
        "| shape | params | torch bf16 state (8 B/param) | DeepSpeed bf16 ZeRO-0 (16) | ZeRO-3 ranks to fit | "
        "update tokens/s at MFU | decode tokens/s bound (B=256, 1k context) | colocated on one card |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in SHAPES.values():
        p = s.params()
        torch_state = state_bytes_per_param("torch", 2) * p
        ds0 = state_bytes_per_param("deepspeed", 2, 0) * p
        act = activation_bytes(s, 8 * 1024, 8 * 512, 2)
        gen = generate_peak_bytes(s, 2, 256, 512, 512)
        need = next(
            n
            for n in range(1, 1025)
            if state_bytes_per_param("deepspeed", 2, 3, n) * p + act < card_gib * GiB * 0.9
        )
        tps = mfu * bf16_tflops * 1e12 / update_flops_per_token(s, 1024)
        dec = decode_tokens_per_s_bound(s, 2, 256, 1024, bytes_per_s)
        colocated = torch_state + act + gen - p * 2  # HF rollout shares the trainer's weights
        fits = "yes" if colocated < card_gib * GiB else "no"
        rows.append(
            f"| {s.name} | {p / 1e9:.2f}B | {torch_state / GiB:.1f} GiB | {ds0 / GiB:.1f} GiB | {need} | "
            f"{tps:,.0f} | {dec:,.0f} | {fits} ({colocated / GiB:.0f} GiB) |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--card-gib", type=float, default=80.0, help="GPU memory of one card")
    ap.add_argument("--bf16-tflops", type=float, default=790.0, help="measured bf16 matrix-product peak")
    ap.add_argument("--mfu", type=float, default=0.4, help="the update's model FLOPs utilisation")
    ap.add_argument("--bytes-per-s", type=float, default=3.0e12, help="measured device memory bandwidth")
    args = ap.parse_args(argv)
    print(table(args.card_gib, args.bf16_tflops, args.mfu, args.bytes_per_s))


if __name__ == "__main__":
    main()
