"""The configuration tree, validated once, shared by every process.

Runs in: every process. The launcher builds an `EngineConfig`, resolves the model to a local
HF directory, and hands each child the msgpack bytes of it (`encode()` / `decode()`), so
spawning passes no pickled objects of ours. Imports no torch.

Invariant: an `EngineConfig` that exists has been through `validate()`.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

_C = TypeVar("_C", bound=msgspec.Struct)

#: KV blocks hold this many tokens everywhere in vx.
BLOCK_SIZE = 16
#: Default CPU KV pool when --kv-cache-memory is not given.
DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3
#: Below this device memory the server's token budget is 8,192; at or above, 16,384.
LARGE_DEVICE_BYTES = 160 * 1024**3


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What to load. `path` is a local HF directory once the launcher has resolved `model`."""

    model: str = "smollm2-135m"
    path: str = ""
    served_model_name: str = ""
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    max_model_len: int | None = None  # None: the model's own limit
    seed: int = 0
    #: None | "int8" | "int4": weight-only quantized linears on CPU (vx.gpu.layers.quantization).
    quantization: str | None = None


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    block_size: int = BLOCK_SIZE
    #: CPU: bytes for the KV pool. None means DEFAULT_CPU_KV_CACHE_BYTES.
    kv_cache_memory_bytes: int | None = None
    #: GPU: fraction of device memory vx may use (weights + activations + KV).
    gpu_memory_utilization: float = 0.92
    enable_prefix_caching: bool = True
    #: Tests: force an exact pool size, bypassing the memory-based sizing. In the pool's own
    #: blocks: one layer's K/V in each of a group's layers where the model has several
    #: KV-cache groups (`vx.gpu.kv_cache`), else every layer's.
    num_blocks_override: int | None = None


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    #: Prompts longer than this are chunked at this size even when budget remains (0: off).
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = True
    #: While fewer than `small_step_running` requests run and fewer are held (running or
    #: waiting), a step takes at most this many tokens (0: off). The CPU server sets 192, the
    #: fused C step's rows: with few streams, small prefill chunks give a burst's first
    #: prompts their first tokens sooner at the same rate per token; with many, full-budget
    #: steps spread each step's decode work (attention over every running request's KV, the
    #: LM head) over more prefill tokens.
    small_step_tokens: int = 0
    small_step_running: int = 48
    #: While fewer than `small_step_running` run but that many are held (a burst waits), a
    #: step takes at most this many tokens (0: the full budget). The CPU server sets 512: at
    #: 192 tokens a step a burst of 64 arrivals was slow to get running and cost throughput;
    #: at the full 1,024 the throughput was the same and TTFT p50 longer (measured at c = 64
    #: on a 2-core CPU).
    burst_step_tokens: int = 0


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True):
    tensor_parallel_size: int = 1
    #: Pipeline stages (`--pipeline-parallel-size`), each of `tensor_parallel_size` Workers.
    pipeline_parallel_size: int = 1
    #: Nodes the Workers span (`--nnodes`); node r runs global ranks [r * k, (r + 1) * k),
    #: k = TP x PP / nnodes. Node 0 runs the front and the EngineCore too; the others are headless
    #: (`vx.headless`).
    nnodes: int = 1
    #: Node 0's address: torch.distributed's store listens on `master_port`, the EngineCore's
    #: link to the other nodes on `master_port + 1`.
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    @property
    def world_size(self) -> int:
        """Workers of one data-parallel rank: TP x PP."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def workers_per_node(self) -> int:
        return self.world_size // self.nnodes

    data_parallel_size: int = 1
    #: Data-parallel ranks on this node (`--data-parallel-size-local`; 0: all of them). Fewer
    #: than `data_parallel_size`: the other ranks run on headless nodes (`vx.headless`), each
    #: EngineCore joined to the front over a Link to `data_parallel_address`'s
    #: `data_parallel_rpc_port`.
    data_parallel_size_local: int = 0
    #: This node's first data-parallel rank (`--data-parallel-start-rank`; 0 on the front's).
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550

    @property
    def dp_local(self) -> int:
        """Data-parallel ranks on this node."""
        return self.data_parallel_size_local or self.data_parallel_size

    @property
    def dp_remote(self) -> bool:
        """Some data-parallel ranks run on other nodes."""
        return self.dp_local < self.data_parallel_size


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Speculative decoding (`--speculative-config`, vLLM's JSON keys); `method` None: off.

    `ngram`: prompt lookup over a request's own tokens (`vx.gpu.spec_decode.ngram`): the
    longest suffix of `prompt_lookup_max` down to `prompt_lookup_min` tokens seen before
    proposes the `num_speculative_tokens` tokens that followed it. With async scheduling
    the EngineCore schedules draft slots and the Workers fill them (`vx.gpu.spec_decode.slots`).

    `draft_model`: a small model (`model`, resolved to a local directory by the launcher) with
    the target's vocabulary drafts `num_speculative_tokens` greedy tokens per step
    (`vx.gpu.spec_decode.draft_model`)."""

    method: str | None = None
    #: the draft model (`draft_model`): an HF directory, a .gguf or the default model's alias
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5

    @property
    def enabled(self) -> bool:
        return self.method is not None


class KVEventsConfig(msgspec.Struct, frozen=True, kw_only=True):
    """KV-cache events for routers (`--kv-events-config`, vLLM's JSON keys; vx/core/kv_events.py).

    Off unless `enable_kv_cache_events`. `publisher` "zmq" (the default once enabled) or
    "null"; `endpoint` the PUB address (a wildcard binds, a host connects; rank r of data
    parallel takes port + r), `replay_endpoint` an optional ROUTER address for missed batches,
    `buffer_steps` how many batches it keeps, `hwm` the PUB high-water mark. `max_queue_size` is
    accepted for vLLM's configs and unused: vx publishes from the engine loop, with no queue."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything an EngineCore and its Workers need; the front adds its HTTP settings."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    device: str = "cpu"  # cpu | cuda
    #: Per-step timing breakdown logged at INFO (`vx serve --profile-steps`).
    profile_steps: bool = False
    #: Seconds a step may take before the engine declares its workers stuck.
    step_timeout_s: float = 30.0
    #: Torch threads for each worker on CPU (None: all cores minus what the other processes need).
    num_threads: int | None = None
    enforce_eager: bool = False
    #: Batch-invariant inference (`--batch-invariant`): a request's tokens and logprobs do not
    #: depend on the other requests in its steps, the prefix cache, the prompt's chunking or
    #: preemption. Every row count takes one GEMM (vx's AMX, VNNI or panel GEMM), the LM head
    #: no int8 screen, prompt tokens the prefill attention and output tokens the decode
    #: attention (fp32: every token); on CPUs, in bf16 or fp32, only.
    batch_invariant: bool = False
    speculative: SpeculativeConfig = SpeculativeConfig()
    kv_events: KVEventsConfig = KVEventsConfig()

    def validate(self) -> None:
        s, c, p = self.scheduler, self.cache, self.parallel
        if s.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if s.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if s.small_step_tokens < 0:
            raise ValueError("small_step_tokens must be >= 0 (0: off)")
        if s.burst_step_tokens < 0:
            raise ValueError("burst_step_tokens must be >= 0 (0: the full budget)")
        if c.block_size != BLOCK_SIZE:
            raise ValueError(f"block_size must be {BLOCK_SIZE}")
        if not 0.0 < c.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if c.kv_cache_memory_bytes is not None and c.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if p.tensor_parallel_size < 1 or p.data_parallel_size < 1 or p.pipeline_parallel_size < 1:
            raise ValueError("parallel sizes must be at least 1")
        if p.nnodes > 1:
            if p.world_size % p.nnodes:
                raise ValueError(f"TP x PP ({p.world_size}) is not divisible by nnodes {p.nnodes}")
            if p.data_parallel_size != 1:
                raise ValueError(
                    "--nnodes (one EngineCore's Workers across nodes: TP or PP across nodes) "
                    "with data parallel is not supported: each data-parallel rank's TP x PP "
                    "Workers must fit on one node; across nodes, place whole ranks with "
                    "--data-parallel-size-local"
                )
            if not 0 < p.master_port < 65535:
                raise ValueError("--nnodes > 1 needs --master-port (or MASTER_PORT)")
        if not 0 < p.dp_local <= p.data_parallel_size:
            raise ValueError("need 0 < --data-parallel-size-local <= --data-parallel-size")
        if p.data_parallel_start_rank < 0 or (
            p.data_parallel_start_rank + p.dp_local > p.data_parallel_size
        ):
            raise ValueError("--data-parallel-start-rank + local ranks exceed --data-parallel-size")
        if p.dp_remote and not 0 < p.data_parallel_rpc_port < 65536:
            raise ValueError("data parallel across nodes needs --data-parallel-rpc-port")
        if p.pipeline_parallel_size > 1 and self.speculative.enabled:
            raise ValueError("speculative decoding is not implemented with pipeline parallel")
        if self.model.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"unknown dtype {self.model.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}")
        if self.model.quantization not in (None, "int8", "int4"):
            raise ValueError(f"unknown quantization {self.model.quantization!r}")
        if self.model.quantization is not None and self.device != "cpu":
            raise ValueError("quantization is implemented for CPU only")
        sp = self.speculative
        if sp.method not in (None, "ngram", "draft_model"):
            raise ValueError(
                f"unknown speculative method {sp.method!r} (known: ngram, draft_model)"
            )
        if (sp.method == "draft_model") != (sp.model is not None):
            raise ValueError('the "draft_model" method, and it alone, takes a "model"')
        if sp.enabled:
            if not 1 <= sp.num_speculative_tokens <= 16:
                raise ValueError("num_speculative_tokens must be in [1, 16]")
            if not 1 <= sp.prompt_lookup_min <= sp.prompt_lookup_max:
                raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
            if self.device != "cpu":
                raise ValueError("speculative decoding is implemented for CPU only")

        kv = self.kv_events
        if kv.publisher not in ("zmq", "null"):
            raise ValueError(f"unknown KV events publisher {kv.publisher!r} (known: zmq, null)")
        if kv.enabled and not c.enable_prefix_caching:
            raise ValueError("KV events need prefix caching (they report its hashed blocks)")
        if kv.buffer_steps < 1 or kv.hwm < 0:
            raise ValueError("KV events need buffer_steps >= 1 and hwm >= 0")

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> EngineConfig:
        return msgspec.msgpack.decode(data, type=cls)


def default_max_num_batched_tokens(
    device_memory_bytes: int | None, *, offline: bool, device: str = "cuda"
) -> int:
    """The per-hardware, per-entry-point token budget (vLLM's scheme).

    On CPU the server gets 1,024, half vLLM's CPU default: a step's GEMMs already run at the
    library's full rate from a few hundred rows, so a smaller step costs no throughput, while
    every running stream waits out each prefill chunk and the first prompts of a burst finish
    a step sooner (2-core SmolLM2 server, 32-64 clients of 128-token prompts: 1,024 beat 2,048
    in output tok/s and TTFT p50 in two interleaved runs, docs/performance.md). A GPU server
    gets 8,192 under 160 GiB and 16,384 at or above. The offline `LLM` class gets twice the
    server's budget.
    """
    base = 8192
    if device != "cuda":
        base = 1024
    elif device_memory_bytes is not None and device_memory_bytes >= LARGE_DEVICE_BYTES:
        base = 16384
    return base * 2 if offline else base


def parse_speculative_config(text: str | dict | None) -> SpeculativeConfig:
    """`--speculative-config`'s JSON (vLLM's keys: method, model, num_speculative_tokens,
    prompt_lookup_min, prompt_lookup_max), or a dict of them; None: off. Unknown keys are
    refused."""
    return _parse_json_config(text, SpeculativeConfig, "--speculative-config")


def parse_kv_events_config(text: str | dict | None) -> KVEventsConfig:
    """`--kv-events-config`'s JSON (vLLM's keys), or a dict of them; None: off. Unknown keys
    are refused."""
    return _parse_json_config(text, KVEventsConfig, "--kv-events-config")


def _parse_json_config(text: str | dict | None, cls: type[_C], flag: str) -> _C:
    """A flag's JSON object (or a dict) as `cls`, its default where None or empty; a
    ValueError naming `flag` for bad JSON, unknown keys or wrong types."""
    if text is None or text == "":
        return cls()
    try:
        data = msgspec.json.decode(text) if isinstance(text, str) else text
        if not isinstance(data, dict):
            raise ValueError("a JSON object")
        unknown = sorted(set(data) - set(cls.__struct_fields__))
        if unknown:
            raise ValueError(f"unknown keys {unknown}")
        return msgspec.convert(data, cls, strict=True)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"bad {flag}: {e}") from None
