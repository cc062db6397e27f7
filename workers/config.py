"""Typed engine configuration (pydantic, ``extra="forbid"``: a misspelled key is an error naming it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.scheduler import SchedulerConfig

MAX_SPECULATIVE_TOKENS = 16  # beyond this a verify pass costs more than any acceptance can repay


class StructuredOutputsConfig(BaseModel):
    """Engine-wide settings of grammar-constrained decoding."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_whitespace: Literal["compact", "flexible"] = Field(
        "compact",
        description="Whitespace a JSON schema or json_object allows between tokens. 'compact': none but the "
        "separators ', ' and ': ' (what json.dumps writes), so every key, quote and brace the schema fixes is "
        "forced and proposed as a free draft, and a small model cannot loop on whitespace; 'flexible': any JSON "
        "whitespace (newlines, indentation), as the JSON grammar allows.",
    )
    json_closed_objects: bool = Field(
        True,
        description="An object schema that lists properties but says nothing of additionalProperties is decoded as "
        "if it said false (xgrammar's strict mode): a small model otherwise invents extra keys until max_tokens. "
        "Only narrows the output: what it writes is valid under the schema as given. False: extra keys allowed.",
    )
    max_forced_tokens: int = Field(
        16,
        ge=0,
        le=64,
        description="Most grammar-forced tokens proposed as drafts per request per step (beyond "
        "num_speculative_tokens: they cost no proposer work and are nearly always accepted); 0 = no grammar drafts.",
    )
    compile_timeout_s: float = Field(
        10.0,
        gt=0.0,
        le=300.0,
        description="A grammar that takes longer than this to compile is refused with a 400. Compiling runs off "
        "the engine's step loop, so a slow one never stalls other requests.",
    )
    max_spec_bytes: int = Field(
        65536, ge=64, description="Largest schema, regex, choice list or grammar accepted, in bytes (400 above it)."
    )
    cache_size: int = Field(256, ge=0, description="Compiled grammars kept, by hash of their source (0 = none).")


class ProposerConfig(BaseModel):
    """One speculation method the engine may use. ``options`` go to the proposer's own validated config."""

    model_config = ConfigDict(extra="forbid")

    name: Literal["ngram", "suffix", "draft_model", "eagle"] = Field(description="Proposer method.")
    options: dict[str, Any] = Field(default_factory=dict, description="Method options (e.g. min_n, max_n).")
    model: str | None = Field(
        None, description="draft_model only: 'smollm2', 'target' (the target as its own draft) or a local HF dir."
    )


class EngineConfig(BaseModel):
    """Everything one target engine needs; shared by the in-process engine and the Serve target worker."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("smollm2", description="'smollm2' (the shipped GGUF) or a local Hugging Face model directory.")
    served_model_name: str = Field("SmolLM2-135M-Instruct", description="Name reported by /v1/models.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Weights and activations. 'auto': bfloat16 where its GEMMs are at least as fast as fp32's (CUDA; a "
        "CPU with AMX or AVX512-BF16; a CPU with AVX2 and FMA whose cpu_gemm is the native kernel, which reads half "
        "the bytes), float32 elsewhere (bf16 through oneDNN without bf16 instructions multiplies fp32 copies). With "
        "batch_invariant on, output is a pure function of the request in either dtype.",
    )
    batch_invariant: bool = Field(
        True,
        description="Kernels whose result for a position does not depend on the rest of the step (rows fed, "
        "neighbours, slot, prefix-cache hit): output is then bit-identical with speculation on or off, alone or "
        "in any batch (workers/batch_invariant.py). False runs the library's kernels as chosen by shape (SDPA, "
        "whole-prompt GEMMs, torch row-wise ops), whose rounding depends on the batch (greedy bf16 output then "
        "changes with load): faster prefill, but on a CPU where the native kernels build, slower decode.",
    )
    verification: Literal["coupled", "rejection"] = Field(
        "coupled",
        description="How a sampled request's drafts are checked. 'coupled': a draft is accepted iff it equals the "
        "target's own position-keyed sample, so output is exactly plain decoding's for any K, proposer or path, and "
        "a seeded request reproduces at any load; drafts send no distribution. 'rejection': Leviathan et al. "
        "rejection sampling (the same distribution, but the random draws depend on K, so seeded text depends on load).",
    )
    device: str = Field("auto", description="'auto' picks CUDA when present, else CPU.")
    cpu_gemm: Literal["auto", "onednn", "mkl", "native"] = Field(
        "auto",
        description="CPU matmul backend. 'auto': 'native' on a CPU with AVX-512 and no AMX (a bf16 model also needs "
        "AVX512-BF16), where its fused forward decoded faster at every batch size measured, and on a CPU with AVX2 "
        "and FMA, else 'onednn' (docs/benchmarks.md#gemm_ab). 'onednn' "
        "prepacks every weight once, which makes steps faster at every "
        "batch size (docs/benchmarks.md); 'mkl' is F.linear, the call HF's own forward makes, so "
        "fp32 logits are bit-identical to HF. oneDNN sums in another order: logits differ from HF's by up to "
        "~1.2e-4 (HF's own fp32 forward is 4e-5 off the fp64 one). 'native': the project's own linear kernel "
        "(workers/kernels/invariant_linear.c, built for this CPU like the native attention) on the plain weights: "
        "every output is one fixed-order sum, so it is batch-invariant at every row count with no probing or "
        "padding, and at a few rows it streams the weights at close to memory bandwidth; oneDNN where no C compiler "
        "is found (a log line says so). Each backend rounds differently: every replica of a deployment must use the "
        "same one. Ignored on CUDA.",
    )
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads; None keeps torch's default.")
    cpu_priority: Literal["engine_first", "inherit"] = Field(
        "engine_first",
        description="The serving loop's thread and its OpenMP pool. 'engine_first': normal time-sharing at nice 0, "
        "ahead of the rest of Ray, which the launchers start at SCHED_BATCH with its daemons further back "
        "(cluster/cpu_priority.py): with every core running an engine thread, another process waking up "
        "otherwise stalls a whole parallel op. 'inherit': whatever Ray started the worker with.",
    )
    max_num_seqs: int = Field(
        128,
        ge=1,
        le=1024,
        description="Running requests; more wait in the queue. Costs no memory by itself: KV comes from the block "
        "pool (kv_cache_memory_gb), and requests beyond what the pool holds wait or are preempted.",
    )
    max_model_len: int = Field(
        8192,
        ge=16,
        description="Context length per request (prompt + output + drafts), up to the model's own "
        "limit. Memory comes from the KV block pool (kv_cache_memory_gb), not from this times max_num_seqs.",
    )
    kv_cache_memory_gb: float = Field(
        4.0,
        gt=0,
        le=4096,
        description="GiB of the paged KV cache's block pool, shared by every request (vLLM's VLLM_CPU_KVCACHE_SPACE). "
        "4 GiB holds ~93k tokens of SmolLM2 in fp32 (30 layers x 2 x 3 kv heads x 64 x 4 bytes = 45 KiB per token), "
        "e.g. 11 requests of 8192 tokens or 45 of 2048, and twice that in bf16 (kv_cache_dtype); requests "
        "beyond what the pool holds wait, and a running request is preempted (recomputed later, output unchanged) "
        "when decoding runs out of blocks. Capped at what max_num_seqs "
        "requests of max_model_len can use. Must hold one request of max_model_len (an error naming this key).",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="What the KV cache stores keys and values in. 'auto': the model's dtype. A bfloat16 model's "
        "keys and values are bf16 values, so 'bfloat16' holds them exactly in half the bytes of 'float32' (twice the "
        "tokens per GiB) and every logit is bit-identical either way; 'bfloat16' with a float32 model would round "
        "them and change output, so it is refused.",
    )
    block_size: int = Field(
        16,
        ge=16,
        le=256,
        multiple_of=16,
        description="Tokens per KV cache block: the unit of allocation and of prefix caching (only full blocks are "
        "cached). A multiple of 16, the native attention kernel's key-vector width.",
    )
    max_num_batched_tokens: int = Field(
        256,
        ge=16,
        description="Most tokens one engine step feeds (a hard cap; the scheduler's latency budget "
        "usually binds first while requests decode); long prompts are prefilled in chunks.",
    )
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig,
        description="How prompt chunks share a step with decoding streams: a latency budget per step "
        "(target_itl_ms or itl_ratio) and a soft time-to-first-token goal (max_ttft_ms); workers/scheduler.py.",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse the KV of a prompt prefix another request already computed (the chat template's system "
        "prompt, a shared few-shot header, a repeated prompt) instead of prefilling it again: vLLM's automatic prefix "
        "caching over hashed full blocks (block_size tokens), reference-counted, least recently used evicted first. "
        "Output is unchanged; the prefill work saved shows in usage.prompt_tokens_details."
        "cached_tokens. Requests whose proposer reads the target's hidden states (eagle) always prefill in full.",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        le=64,
        description="Tokens per streamed chunk after the first (SGLang's stream_interval): every chunk is a message "
        "through the replica, the ingress and the HTTP proxy, whose CPU the engine shares on a small machine. The "
        "first token is always sent at once; the text and tokens are the same, in fewer chunks.",
    )
    decode_steps: int = Field(
        1,
        ge=1,
        le=64,
        description="Plain decode steps one engine iteration may run with no commit between them (vLLM's "
        "num_scheduler_steps), where the scheduler, the output handling and the Python between steps run once for "
        "all of them: when every running request decodes greedily, or samples under coupled verification, with "
        "nothing else per token to compute in Python (no drafts this step, logprobs, penalties, grammar or "
        "recorded events, no proposer reading hidden states), nothing waits to be admitted and the fused native "
        "forward runs (cpu_gemm='native' on the CPU). The steps then run in one native call, sampled rows raced "
        "in it (a race that cannot be sure ends the call there for the sampler's definition). Each step is the "
        "one a single step would run: the output is the same, bit for bit. The price is granularity: "
        "tokens stream in chunks of up to this many, and a request arriving meanwhile waits for the call to end. "
        "Stops (EOS, stop strings) are found after the call; steps past one are discarded.",
    )
    num_speculative_tokens: int = Field(
        4, ge=0, le=MAX_SPECULATIVE_TOKENS, description="K_max: most draft tokens verified per request per step."
    )
    structured_outputs: StructuredOutputsConfig = Field(
        default_factory=StructuredOutputsConfig,
        description="Grammar-constrained decoding (response_format, tools, structured_outputs): JSON whitespace, "
        "grammar drafts, compile bounds; workers/grammar.py.",
    )
    proposers: list[ProposerConfig] = Field(
        default_factory=lambda: [ProposerConfig(name="ngram")], description="Configured proposers; first = default."
    )

    @model_validator(mode="after")
    def _kv_cache_dtype_keeps_output(self) -> EngineConfig:
        """bf16 KV under fp32 weights rounds every key and value: output would depend on a memory setting."""
        if self.dtype == "float32" and self.kv_cache_dtype == "bfloat16":
            raise ValueError(
                "kv_cache_dtype 'bfloat16' with dtype 'float32' would round every key and value and change output: "
                "use kv_cache_dtype 'auto' or 'float32', or dtype 'bfloat16'"
            )
        return self
