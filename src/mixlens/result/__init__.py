"""Result objects: `Attribution` (one method, labelled array) and `Analysis` (one `analyze` call), and their files.

The package, by role:

- `rows`: the per-input store every result holds its arrays in (`InputRows`, `InputBiasRows`), and `TOKEN_AXES`;
- `attribution`, `analysis`, `explanation`: the data model (`Attribution`, `Analysis`, `Explanation`, `Explained`);
- `files`: writing and reading files (`atomic_write`, the safetensors + JSON manifest format, tied by a save id);
- `validation`, `loading`: checking untrusted loaded data (a saved file, analyze's JSON) before any value is used.
"""

from mixlens.atomic import WRITTEN, atomic_write
from mixlens.result.analysis import Analysis
from mixlens.result.attribution import Attribution
from mixlens.result.explanation import ANSWER_AXES, Explained, Explanation
from mixlens.result.files import ANALYSIS_FORMAT, ATTRIBUTION_FORMAT, MAX_HEADER, SAVE_ID
from mixlens.result.rows import TOKEN_AXES, InputBiasRows, InputRows

__all__ = [
    "ANSWER_AXES",
    "ANALYSIS_FORMAT",
    "ATTRIBUTION_FORMAT",
    "MAX_HEADER",
    "SAVE_ID",
    "TOKEN_AXES",
    "WRITTEN",
    "Analysis",
    "Attribution",
    "InputBiasRows",
    "InputRows",
    "Explained",
    "Explanation",
    "atomic_write",
]
