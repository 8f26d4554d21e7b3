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
# what runs the models: each "auto" is decided from the sources and the machine at load (infer/pair/loader.py)
BACKEND = DEVICE = DTYPE = COMPILE = QUANTIZE = CROSS_VOCAB = "auto"
TP = 1  # tensor-parallel ranks
# what a quantization is calibrated on (torch's w8a8: SmoothQuant's factors) and its quality measured on (llama.cpp's
# requantization) when no texts are given: prose and code, a few hundred tokens
CALIBRATION_TEXT = """The committee met on Tuesday to review the budget. After a long discussion about the
costs of the new library wing, the members agreed to postpone the vote until the engineers had
finished their report. "We cannot approve what we have not measured," said the chair.

def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    \"\"\"Merge two sorted lists into one sorted list.\"\"\"
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]

Q: A train travels 240 km in 3 hours. How far does it travel in 5 hours at the same speed?
A: Its speed is 240 / 3 = 80 km per hour, so in 5 hours it travels 80 * 5 = 400 km. #### 400

Rewrite the sentence in the passive voice: "The students planted three trees in the park."
Three trees were planted in the park by the students.
"""
