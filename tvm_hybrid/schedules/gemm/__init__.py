"""The GEMM template: analysis (``analysis.py``), kernel selection and knobs
(``heuristics.py``), the schedule (``template.py``) and its search space (``space.py``)."""
