"""What a GGUF file holds, for comparing two files."""
from __future__ import annotations

import numpy as np


def arch_fields_and_tensors(path) -> tuple:
    """({key: value} of the architecture's metadata, {name: array} of the tensors)."""
    import gguf
    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    md = {f.name: f.contents() for f in r.fields.values() if f.name.startswith(arch + ".")}
    return md, {t.name: np.array(t.data) for t in r.tensors}
