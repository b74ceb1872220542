"""Post-processors: the special tokens encode() adds around a sequence."""
from .errors import TokenizerError, UnsupportedTokenizerError


class TemplateProcessing:
    def __init__(self, d, where):
        single = d.get("single", [])
        if isinstance(single, str):
            raise TokenizerError(f"{where}.single: expected the serialized list form")
        self.pieces = []
        specials = d.get("special_tokens", {}) or {}
        for i, item in enumerate(single):
            if "SpecialToken" in item:
                name = item["SpecialToken"]["id"]
                if name not in specials:
                    raise TokenizerError(f"{where}: special token {name!r} used in the template "
                                         "is missing from special_tokens")
                self.pieces.append(list(specials[name]["ids"]))
            elif "Sequence" in item:
                if item["Sequence"].get("id", "A") != "A":
                    raise TokenizerError(f"{where}.single[{i}]: a single-sequence template can only use $A")
                self.pieces.append(None)
            else:
                raise TokenizerError(f"{where}.single[{i}]: unknown template item {item!r}")

    def added(self):
        return sum(len(p) for p in self.pieces if p is not None)

    def process(self, ids):
        out = []
        for p in self.pieces:
            out.extend(ids if p is None else p)
        return out


class Wrap:
    """BertProcessing / RobertaProcessing: cls + ids + sep."""

    def __init__(self, d):
        self.cls = d["cls"][1]
        self.sep = d["sep"][1]

    def added(self):
        return 2

    def process(self, ids):
        return [self.cls] + list(ids) + [self.sep]


class Noop:
    def added(self):
        return 0

    def process(self, ids):
        return ids


class Sequence:
    def __init__(self, items):
        self.items = items

    def added(self):
        return sum(p.added() for p in self.items)

    def process(self, ids):
        for p in self.items:
            ids = p.process(ids)
        return ids


def build(d, where="post_processor"):
    if d is None:
        return None
    t = d.get("type")
    if t == "TemplateProcessing":
        return TemplateProcessing(d, where)
    if t == "ByteLevel":
        return Noop()
    if t in ("BertProcessing", "RobertaProcessing"):
        return Wrap(d)
    if t == "Sequence":
        return Sequence([build(x, f"{where}.processors[{i}]")
                         for i, x in enumerate(d.get("processors", []))])
    raise UnsupportedTokenizerError(f"{where}: post-processor type {t!r} is not supported "
                                    "(supported: TemplateProcessing, ByteLevel, Sequence)")

