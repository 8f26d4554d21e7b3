"""`cactus eval`: tasks and their grading (tasks), the code sandbox (sandbox), resumable runs
(checkpoint), what quantization costs in quality (quality), the lm-evaluation-harness model
(lm_eval_adapter)."""
