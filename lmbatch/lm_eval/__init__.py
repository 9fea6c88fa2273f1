"""lmbatch as lm-evaluation-harness's backend: `backend.LMBatch` and `lmbatch lm-eval`, the engine it loads
early (`engine`), lm-eval's requests as token ids (`tokens`) and generations (`generate`), its task index
(`index`). Its modules import the third-party `lm_eval` absolutely; this package imports nothing."""
