"""Every built-in default, in one place. ``Settings`` (app/config/settings.py), the engine's
``GenerationParams``, ``SamplingParams``, the rules' parameters and the sweep commands all read
them from here; a profile or a flag overrides them (defaults < profile < flags)."""

RULE = "sps"  # the verifier's own distribution: Cactus is chosen by name (profiles/cactus.yaml, --rule), docs/eval.md says why
DELTA = 1.0  # nats: the divergence budget of cactus / cactus-exact (the paper's delta = 1)
NUM_DRAFT_TOKENS = 4  # k
MAX_DRAFT_TOKENS = 64  # k_max for -k auto: free drafts run long where text is copied (docs/performance.md)
NGRAM_MAX, NGRAM_MIN = 4, 1  # prompt lookup: the longest and shortest n-gram matched
TEMPERATURE = 0.6
TOP_K = 20  # 0 = off
TOP_P = 0.95  # 1 = off
MAX_TOKENS = 256
BENCH_RULES = "sps,cactus"  # bench and eval compare these rules when --rules is not given
QUALITY_TOLERANCE = 0.03  # nats/token of mean NLL a quantization may cost to be chosen by --quantize auto
# what runs the models: each "auto" is decided from the sources and the machine at load (infer/load/loader.py)
BACKEND = DEVICE = DTYPE = COMPILE = QUANTIZE = CROSS_VOCAB = "auto"
TP = 1  # tensor-parallel ranks
