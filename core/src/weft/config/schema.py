"""The ``weft.toml`` schema: one msgspec Struct per table, each option with its type, range, default and
description (``weft config show`` and the CLI flags are generated from them).

::

    model = "smollm2-135m-instruct"   # alias, local folder, GGUF file, or HF repo id (downloaded if missing)
    [use]                             # which plugin fills each slot; "auto" lets the platform decide
    platform = "auto"
    attention = "auto"
    loader = "auto"
    tokenizer = "auto"
    kv_connector = "none"
    structured_output = "auto"        # grammar backend (weft-xgrammar); tool_parser and reasoning_parser likewise
    [engine]
    max_num_seqs = 64
    generation_config = "auto"        # sampling defaults: the model's; "none": Weft's;
                                      # or a folder with generation_config.json
    [server]
    port = 8000
    [plugins]
    lock = "weft.lock"                # optional: `weft plugins freeze` output; engine starts verify against it
    [plugins.mooncake]                # each plugin's own options, checked against its Options Struct

Loading, overrides and validation with errors that name the source, the key path and what was expected
live in :mod:`weft.config.load`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

DEFAULT_MODEL = "smollm2-135m-instruct"

PositiveInt = Annotated[int, Meta(ge=1)]


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class UseConfig(_Section, frozen=True):
    """Which plugin fills each slot. ``auto`` lets the platform or the model source decide."""

    platform: Annotated[str, Meta(description="platform plugin, or auto: probe the hardware")] = "auto"
    attention: Annotated[str, Meta(description="attention backend, or auto: the platform's default")] = "auto"
    loader: Annotated[str, Meta(description="weight loader, or auto: the first that accepts the model source")] = "auto"
    tokenizer: Annotated[str, Meta(description="tokenizer, or auto: the one the loader names for the source")] = "auto"
    kv_connector: Annotated[str, Meta(description="KV connector, or none")] = "none"
    structured_output: Annotated[
        str, Meta(description="structured-output backend, none, or auto: the installed one of highest priority")
    ] = "auto"
    tool_parser: Annotated[
        str, Meta(description="tool-call parser, none, or auto: the one made for the model's architecture")
    ] = "auto"
    reasoning_parser: Annotated[
        str, Meta(description="reasoning parser, none, or auto: the one made for the model's architecture")
    ] = "auto"
    mm_processor: Annotated[
        str,
        Meta(description="multimodal (image) processor, none, or auto: the one made for the model's architecture"),
    ] = "auto"
    encoder_connector: Annotated[
        str,
        Meta(
            description="what hands image encoder outputs between instances (E/P/D): folder (files in "
            "engine.encoder_store), a plugin's (mooncake), none, or auto: folder where engine.encoder_store is set"
        ),
    ] = "auto"
    ops: Annotated[
        dict[str, str], Meta(description="op name -> implementation to force, e.g. {rms_norm = 'torch'}")
    ] = {}


class DistributedConfig(_Section, frozen=True):
    """Several nodes: one launcher per node (``weft serve`` on each); torchrun's variables fill what is unset."""

    nnodes: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="nodes the model spans; default: $WORLD_SIZE / $LOCAL_WORLD_SIZE under torchrun, else 1",
            ),
        ]
        | None
    ) = None
    node_rank: (
        Annotated[
            int,
            Meta(ge=0, description="this node's index (0 runs the engine); default: $GROUP_RANK or $NODE_RANK, else 0"),
        ]
        | None
    ) = None
    master_addr: (
        Annotated[str, Meta(description="address of node 0, where workers meet; default: $MASTER_ADDR, else 127.0.0.1")]
        | None
    ) = None
    master_port: (
        Annotated[
            int,
            Meta(
                ge=0,
                le=65535,
                description="TCP port of the rendezvous on node 0; default: $MASTER_PORT, else a free one (one node "
                "only)",
            ),
        ]
        | None
    ) = None
    worker_timeout: Annotated[
        float,
        Meta(gt=0, description="seconds a worker may take to start, load, join the others or finish a collective"),
    ] = 600.0


class SpeculativeConfig(_Section, frozen=True):
    """Speculative decoding (docs/speculative.md): a speculator proposes tokens that the model verifies in one
    step; the output is what plain decoding gives (greedy: the same tokens; sampled: the same distribution)."""

    method: Annotated[
        str,
        Meta(
            description="the weft.speculator that proposes tokens: none (off), ngram (prompt lookup over the "
            "request's own tokens), or a plugin's"
        ),
    ] = "none"
    num_speculative_tokens: Annotated[
        int, Meta(ge=1, le=32, description="most tokens proposed for one request per step (k)")
    ] = 4
    model: (
        Annotated[str, Meta(description="the draft model of a speculator that loads one (alias, folder or repo id)")]
        | None
    ) = None
    prompt_lookup_min: (
        Annotated[int, Meta(ge=1, description="ngram: the shortest suffix looked up; default: prompt_lookup_max, or 5")]
        | None
    ) = None
    prompt_lookup_max: (
        Annotated[int, Meta(ge=1, description="ngram: the longest suffix looked up; default: prompt_lookup_min, or 5")]
        | None
    ) = None

    @property
    def enabled(self) -> bool:
        return self.method != "none"


class EngineConfig(_Section, frozen=True):
    """Scheduling, KV cache and numerics."""

    max_num_seqs: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="most requests running in one step; default: the platform's (CPU 64, H200-class GPU 512)",
            ),
        ]
        | None
    ) = None
    max_num_batched_tokens: (
        Annotated[
            int,
            Meta(
                ge=1, description="token budget of one step; default: the platform's (CPU 2048, H200-class GPU 16384)"
            ),
        ]
        | None
    ) = None
    max_model_len: Annotated[int, Meta(ge=1, description="context length; default: the model's")] | None = None
    block_size: Annotated[int, Meta(ge=1, le=4096, description="tokens per KV-cache block")] = 16
    num_kv_blocks: Annotated[int, Meta(ge=1, description="KV-cache blocks; default: sized from memory")] | None = None
    gpu_memory_utilization: Annotated[
        float, Meta(gt=0, le=1, description="share of device memory the engine may use")
    ] = 0.9
    cpu_kv_cache_bytes: Annotated[int, Meta(ge=1, description="KV-cache bytes on the CPU platform")] = 1 << 30
    enable_prefix_caching: Annotated[bool, Meta(description="reuse KV blocks of identical prompt prefixes")] = True
    enable_chunked_prefill: Annotated[bool, Meta(description="split long prompts across steps")] = True
    long_prefill_token_threshold: (
        Annotated[
            int,
            Meta(
                ge=0,
                description="a prefill needing more tokens is long: while other requests wait or run it gets "
                "this many per step, then the budget they leave; default: a quarter of "
                "max_num_batched_tokens; 0: no cap",
            ),
        ]
        | None
    ) = None
    prompt_logprobs_chunk: Annotated[
        int,
        Meta(
            ge=0,
            description="prompt tokens a request asking for prompt logprobs (or echo with logprobs) computes and "
            "scores per step (scoring a token costs passes over the vocabulary: an 8,000-token prompt scored in "
            "2,048-token steps held a concurrent request for tens of seconds); 0: no cap",
        ),
    ] = 256
    encoder_cache_size: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="embedding rows of image encoder outputs kept for reuse (one per image placeholder "
                "position); an image needing more is refused; default: max_num_batched_tokens",
            ),
        ]
        | None
    ) = None
    encoder_store: Annotated[
        str,
        Meta(
            description="the folder of use.encoder_connector = 'folder', shared by instances, where image encoder "
            "outputs are kept by item hash: an instance reads an image's output from it instead of encoding, and "
            "writes what it encodes (E/P/D: the encoder instance writes, the prefill instance reads); empty: none",
        ),
    ] = ""
    max_long_partial_prefills: Annotated[
        int,
        Meta(
            ge=1,
            description="long prefills running at once; a long prompt beyond that waits while shorter ones go first",
        ),
    ] = 1
    dtype: Annotated[
        Literal["auto", "float32", "float16", "bfloat16"],
        Meta(description="weights and activations; auto: the platform's"),
    ] = "auto"
    quantization: Annotated[
        str,
        Meta(
            description="how linear layers store and multiply weights: a weft.quantization method (cpu_int4: "
            "torch's int4 CPU kernel, GGUF blocks kept quantized), none (dense weights in dtype, "
            "quantized checkpoints dequantized), or auto (the method made for the platform and the "
            "model's format, else none)"
        ),
    ] = "auto"
    kv_cache_dtype: Annotated[
        Literal["auto", "fp8"],
        Meta(
            description="elements of the paged KV cache: auto (the model's dtype) or fp8 (float8_e4m3, half the "
            "bytes, so twice the tokens in the same memory; a CUDA GPU of compute capability 8.9 or newer)"
        ),
    ] = "auto"
    cpu_threads: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="compute threads of a CPU worker; default: one per physical core available "
                "(affinity and cgroup quota respected)",
            ),
        ]
        | None
    ) = None
    cpu_affinity: (
        Annotated[
            list[Annotated[int, Meta(ge=0)]],
            Meta(description="CPUs a CPU worker's threads are bound to; default: one per physical core available"),
        ]
        | None
    ) = None
    seed: Annotated[
        int,
        Meta(
            description="seed of the generator shared by requests that give no seed of their own "
            "(their samples then depend on what else runs); a request's 'seed' (weft "
            "generate --sample-seed) makes its own output reproducible"
        ),
    ] = 0
    enforce_eager: Annotated[bool, Meta(description="never capture graphs")] = False
    graph_batch_sizes: (
        Annotated[
            list[Annotated[int, Meta(ge=1)]],
            Meta(
                description="decode batch sizes captured as graphs; default: the platform's (1, 2, 4, 8, then every 8 "
                "up to max_num_seqs where it captures graphs; none on the CPU)"
            ),
        ]
        | None
    ) = None
    decode_overlap: (
        Annotated[
            bool,
            Meta(
                description="split each captured decode step of at least decode_overlap_min_batch rows into two "
                "nano-batches, one's attention on a second stream beside the other's GEMMs (model families that "
                "support it: the Llama family); default: the platform's (off everywhere until a device run measures "
                "it faster than the plain step)"
            ),
        ]
        | None
    ) = None
    decode_overlap_min_batch: Annotated[
        int,
        Meta(ge=2, description="the smallest captured decode batch that decode_overlap splits into nano-batches"),
    ] = 256
    runtime_jit: Annotated[
        Literal["warn", "error"],
        Meta(description="a kernel variant compiled after warm-up: warn (and compile) or error"),
    ] = "warn"
    async_scheduling: (
        Annotated[
            bool,
            Meta(
                description="schedule step N+1 while step N runs on the device; default: on where the platform gains "
                "from it"
            ),
        ]
        | None
    ) = None
    structured_output_fill: Annotated[
        Literal["auto", "thread", "process"],
        Meta(
            description="where grammar matchers accept tokens and fill bitmasks: a thread of the engine core, or a "
            "process of their own (for a backend whose fill holds the GIL, as xgrammar's does, so it runs beside the "
            "core's work); auto: a process where the backend can run its fill there and the machine has 8 CPUs or "
            "more (or structured_output_fill_processes is set), else a thread"
        ),
    ] = "auto"
    structured_output_fill_processes: (
        Annotated[
            int,
            Meta(
                ge=1,
                le=64,
                description="fill processes sharing the matchers (each accepts and fills its own rows of a "
                "step, beside the others); default: one per 4 CPUs, at most 4",
            ),
        ]
        | None
    ) = None
    structured_output_max_bytes: Annotated[
        int,
        Meta(
            ge=1,
            description="longest structured-output constraint, in bytes (a JSON schema's, regex's or grammar's "
            "text, or the choices together); a longer one is a 400. Compile time grows about quadratically with "
            "a schema's size (3,000 properties: 1.5 s on 2 CPUs; 30,000: 96 s)",
        ),
    ] = 128 << 10
    structured_output_compile_timeout: Annotated[
        float,
        Meta(
            gt=0,
            description="seconds a request waits for its constraint to compile; then it fails (a 400 naming this "
            "limit) and the compiles queued behind it move to fresh threads",
        ),
    ] = 30.0
    structured_output_fill_budget: Annotated[
        float,
        Meta(
            ge=0,
            description="CPU seconds one request's grammar may take to fill its token mask in one step (every step "
            "waits for every mask, and an ambiguous grammar's cost grows with each token); past it the request fails "
            "(a 400 naming this limit). Timed in the engine core's fill thread or in each fill process "
            "(structured_output_fill), in the CPU time of the one filling. 0: no budget",
        ),
    ] = 0.05
    structured_output_cache_bytes: Annotated[
        int,
        Meta(
            ge=0,
            description="memory the engine keeps compiled constraints in (as the backend counts them; least "
            "recently used first out, and at most 512 of them); a request keeps its own while it runs",
        ),
    ] = 256 << 20
    distributed_executor_backend: (
        Annotated[
            str,
            Meta(
                description="executor plugin that runs the model on workers: uniproc (one worker in the engine core's "
                "process), mp (one process per device), ray (weft-ray); default: uniproc on one device, mp above"
            ),
        ]
        | None
    ) = None
    tensor_parallel_size: Annotated[
        int, Meta(ge=1, description="devices each layer is sharded over (attention heads, MLP columns, vocabulary)")
    ] = 1
    pipeline_parallel_size: Annotated[int, Meta(ge=1, description="stages the layers are split over")] = 1
    pipeline_partition: (
        Annotated[
            list[Annotated[int, Meta(ge=1)]],
            Meta(description="layers of each pipeline stage, first stage first; default: an even split"),
        ]
        | None
    ) = None
    enable_expert_parallel: Annotated[
        bool, Meta(description="mixture-of-experts models: spread whole routed experts over the tensor-parallel ranks")
    ] = False
    distributed: DistributedConfig = msgspec.field(default_factory=DistributedConfig)
    speculative: SpeculativeConfig = msgspec.field(default_factory=SpeculativeConfig)
    revision: (
        Annotated[
            str,
            Meta(
                description="Hugging Face revision (branch, tag or commit) of a repo id model, for weights and "
                "tokenizer alike; default: the one after '@' in model, else main"
            ),
        ]
        | None
    ) = None
    download_dir: (
        Annotated[
            str,
            Meta(description="Hugging Face cache a repo id downloads into; default: HF_HUB_CACHE, else HF_HOME/hub"),
        ]
        | None
    ) = None
    kv_load_timeout: Annotated[
        float,
        Meta(
            gt=0,
            description="seconds a request may wait for its KV to arrive through the KV connector (an asynchronous "
            "load: a P/D decode instance's receive, a store's background load); then it computes its prompt itself",
        ),
    ] = 120.0
    step_timeout: Annotated[
        float,
        Meta(
            gt=0,
            description="seconds one engine step may run; then a watchdog logs the phase it is stuck in and fails "
            "the requests the engine core holds (/health answers 503 until the step ends)",
        ),
    ] = 300.0
    generation_config: Annotated[
        str,
        Meta(
            description="sampling defaults of requests that leave them unset: auto (the model's generation config), "
            "none (Weft's: temperature 1, top_p 1...), or a folder holding a generation_config.json"
        ),
    ] = "auto"


class ServerConfig(_Section, frozen=True):
    """The OpenAI-compatible HTTP server."""

    host: Annotated[str, Meta(description="address to bind")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description="TCP port (0: any free port)")] = 8000
    api_key: Annotated[str, Meta(description="required bearer token; default: $WEFT_API_KEY if set")] | None = None
    served_model_name: Annotated[str, Meta(description="model id clients use; default: the model's name")] | None = None
    max_body_bytes: Annotated[int, Meta(ge=1, description="largest accepted request body")] = 8 << 20
    max_queued_requests: Annotated[int, Meta(ge=1, description="waiting requests before 503")] = 1024
    shutdown_timeout: Annotated[
        float,
        Meta(
            ge=0, description="on SIGINT/SIGTERM: seconds in-flight requests may take to finish while new ones get 503"
        ),
    ] = 30.0
    request_timeout: Annotated[
        float,
        Meta(
            gt=0,
            description="seconds a request may take from arrival to its last token; then it is stopped "
            "(408; a stream gets an error event)",
        ),
    ] = 1800.0
    header_timeout: Annotated[
        float,
        Meta(gt=0, description="seconds a client may take to send a request's headers; then the connection is closed"),
    ] = 30.0
    body_timeout: Annotated[
        float, Meta(gt=0, description="seconds a client may take to send a request's body; then 408")
    ] = 60.0
    write_timeout: Annotated[
        float,
        Meta(
            gt=0,
            description="seconds a stream's client may leave its output unread (it stopped reading, the socket is "
            "full) before its requests are stopped and their output dropped; bounds what the server buffers for it",
        ),
    ] = 30.0
    health_stall_timeout: Annotated[
        float,
        Meta(
            gt=0,
            description="seconds the engine core may send nothing while requests are in flight before /health "
            "answers 503 (a stopped or hung core process)",
        ),
    ] = 5.0
    tokenizer_threads: Annotated[
        int,
        Meta(
            ge=1,
            description="threads that decode request bodies, render chat templates and tokenize, off the "
            "event loop; a request waits for one when all are busy",
        ),
    ] = 4
    api_server_count: Annotated[
        int,
        Meta(
            ge=1,
            le=64,
            description="API processes serving HTTP on the one port in front of the engine core (vLLM's "
            "--api-server-count): each does its own HTTP, tokenizing, detokenization and streaming, so that the API "
            "side keeps up with a fast engine; /metrics adds up every process's counters",
        ),
    ] = 1
    max_sequences_per_request: Annotated[
        int, Meta(ge=1, description="most sequences one request may expand to (n times the prompts); more is a 400")
    ] = 256
    strict_fields: Annotated[
        bool,
        Meta(
            description="a request field no API of Weft's knows is a 400 naming it; default: accepted and "
            "ignored, logged once per name and listed in the x-weft-ignored-fields header"
        ),
    ] = False
    allowed_media_domains: Annotated[
        list[str] | None,
        Meta(
            description="hosts http(s) image URLs may name (and redirect to), exactly; default: any. Set it on a "
            "server reachable from outside, or clients can make it fetch from its own network"
        ),
    ] = None
    allowed_local_media_path: Annotated[
        str, Meta(description="a folder whose files file: image URLs may read; empty: file: URLs are refused")
    ] = ""
    max_image_bytes: Annotated[
        int, Meta(ge=1, description="most bytes of one encoded image (data URL, download or file)")
    ] = 20 << 20
    max_image_pixels: Annotated[
        int, Meta(ge=1, description="most pixels (width x height) of one image, checked before decoding")
    ] = 7680 * 4320
    max_image_side: Annotated[int, Meta(ge=1, description="most pixels of either side of one image")] = 16384
    limit_mm_per_prompt: Annotated[int, Meta(ge=0, description="most images one prompt may carry")] = 16
    fetch_timeout_s: Annotated[
        float, Meta(gt=0, description="seconds an http(s) image download may take, redirects included")
    ] = 10.0
    max_redirects: Annotated[int, Meta(ge=0, description="redirects followed for one http(s) image URL")] = 3
    special_tokens_in_content: Annotated[
        Literal["text", "control"],
        Meta(
            description="special-token text inside chat messages: text (encoded as plain text, so users cannot "
            "spoof roles) or control (encoded as the control tokens, the old behaviour)"
        ),
    ] = "text"


class WeftConfig(_Section, frozen=True):
    """The whole configuration."""

    model: Annotated[
        str,
        Meta(description="alias, local folder, GGUF file, or HF repo id (org/name[@revision], downloaded if missing)"),
    ] = DEFAULT_MODEL
    plugins_lock: (
        Annotated[
            str,
            Meta(
                description="lock file from `weft plugins freeze` (relative to this file): engine starts refuse a "
                "different installed plugin set; default: $WEFT_PLUGINS_LOCK if set"
            ),
        ]
        | None
    ) = None
    """Spelled ``[plugins] lock`` in weft.toml (``plugins_lock``, the older spelling, is still read; giving both is
    an error): :func:`load_config` moves it here, so ``plugins`` holds only the per-plugin option tables."""
    use: UseConfig = msgspec.field(default_factory=UseConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    plugins: dict[str, dict[str, Any]] = {}
    """Each plugin's own options by plugin name, validated against its Options Struct."""


PLATFORM_SIZED = ("max_num_seqs", "max_num_batched_tokens", "async_scheduling", "decode_overlap")
"""Engine options whose default the platform chooses for its device (:meth:`Platform.engine_defaults`)."""

DERIVED = ("distributed_executor_backend", "graph_batch_sizes", "long_prefill_token_threshold")
"""Engine options whose default follows from other options and the platform
(:func:`weft.resolve.resolve_engine_config` fills them in)."""


def with_platform_defaults(config: WeftConfig, defaults: Mapping[str, Any]) -> WeftConfig:
    """``config`` with each platform-sized engine option the user left unset taken from ``defaults``."""
    chosen = {key: defaults[key] for key in PLATFORM_SIZED if getattr(config.engine, key) is None}
    if not chosen:
        return config
    return msgspec.structs.replace(config, engine=msgspec.structs.replace(config.engine, **chosen))


def world_size(engine: EngineConfig) -> int:
    """Ranks one model spans."""
    return engine.tensor_parallel_size * engine.pipeline_parallel_size


def executor_name(engine: EngineConfig) -> str:
    """The executor ``engine.distributed_executor_backend`` names, or the default for the world size."""
    if engine.distributed_executor_backend is not None:
        return engine.distributed_executor_backend
    return "uniproc" if world_size(engine) == 1 else "mp"
