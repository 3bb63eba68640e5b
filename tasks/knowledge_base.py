"""The retrieval knowledge base: one document per disease and per HPO term, chunked as Med-RwR does.

A disease document gives its name, phenotypes with frequencies, inheritance, clinical course, phenotypes annotated as
absent, and the definitions of its key phenotypes; a term document gives name, definition, synonyms and parents.
Documents are split at line boundaries into chunks of at least ``min_words`` words (a document shorter than that is
one chunk); every chunk after the first repeats the title so it can be retrieved on its own. Chunk ids are stable:
``disease:OMIM:123456#0``, ``term:HP:0001250#0``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator

from tasks.hpo import CLINICAL_COURSE, MODE_OF_INHERITANCE, PHENOTYPIC_ABNORMALITY, Disease, HPOSnapshot, Term

KEY_PHENOTYPES = 5
FEATURES_PER_LINE = 12
_SOURCE_NAMES = {"OMIM": "OMIM", "ORPHA": "Orphanet", "DECIPHER": "DECIPHER"}


def frequency_label(freq: float | None) -> str:
    """A fraction -> HPO's frequency category, in words."""
    if freq is None:
        return "frequency unknown"
    if freq >= 0.995:
        return "obligate (100%)"
    if freq >= 0.8:
        return "very frequent (80-99%)"
    if freq >= 0.3:
        return "frequent (30-79%)"
    if freq >= 0.05:
        return "occasional (5-29%)"
    if freq > 0:
        return "very rare (1-4%)"
    return "not observed (0%)"


def name_key(name: str) -> str:
    """A name as compared: its lowercase words of letters and digits ("Neurofibromatosis, type 1" and
    "Neurofibromatosis type 1" are one key)."""
    return " ".join(re.findall(r"[a-z0-9]+", name.lower()))


def name_variants(disease: Disease) -> list[str]:
    """The disease name plus, for OMIM's inverted names ("Erythermalgia, primary"), the natural word order.

    HPO ships no disease synonyms; these variants serve as synonyms for retrieval and open-ended answer references.
    """
    names = [disease.name]
    parts = [p.strip() for p in disease.name.split(",")]
    inverted = all(p and not re.search(r"\b(and|or|with|due)\b", p) for p in parts)
    if disease.source == "OMIM" and 2 <= len(parts) <= 3 and inverted:
        head = parts[0] if parts[0][:2].isupper() else parts[0][0].lower() + parts[0][1:]
        natural = " ".join([*reversed(parts[1:]), head])
        names.append(natural[0].upper() + natural[1:])
    return names


class KnowledgeBase:
    """Renders documents from a snapshot; classifies annotations by the ontology branch they belong to."""

    def __init__(self, snapshot: HPOSnapshot):
        self.snapshot = snapshot
        self._branch: dict[str, str] = {}
        self.disease_count = Counter(h for d in snapshot.diseases.values() for h in d.phenotypes)

    def branch(self, term_id: str) -> str:
        """'phenotype', 'inheritance', 'course' (onset, progression, ...) or 'other' (modifiers, blood group, ...)."""
        if term_id not in self._branch:
            ancestors = self.snapshot.ancestors(term_id) | {term_id}
            if PHENOTYPIC_ABNORMALITY in ancestors:
                self._branch[term_id] = "phenotype"
            elif MODE_OF_INHERITANCE in ancestors:
                self._branch[term_id] = "inheritance"
            else:
                self._branch[term_id] = "course" if CLINICAL_COURSE in ancestors else "other"
        return self._branch[term_id]

    def features(self, disease: Disease) -> list[str]:
        """Observed (frequency > 0) phenotypic-abnormality annotations, most frequent then most specific first."""
        present = [h for h, f in disease.phenotypes.items() if f != 0 and self.branch(h) == "phenotype"]
        unknown = 0.5  # an unknown frequency sorts between frequent and occasional
        return sorted(present, key=lambda h: (-(disease.phenotypes[h] or unknown), self.disease_count[h], h))

    def disease_lines(self, disease: Disease) -> list[str]:
        """The disease document, one line per retrievable unit."""
        terms = self.snapshot.terms
        lines = [f"{disease.name} ({disease.id}) is a rare disease catalogued in {_SOURCE_NAMES[disease.source]}."]
        aliases = name_variants(disease)[1:]
        if aliases:
            lines.append(f"Also known as: {'; '.join(aliases)}.")
        by_branch: dict[str, list[str]] = {}
        for h in sorted(disease.phenotypes, key=lambda h: terms[h].name):
            by_branch.setdefault(self.branch(h), []).append(terms[h].name)
        labels = {"inheritance": "Inheritance", "course": "Clinical course", "other": "Also annotated"}
        for branch, label in labels.items():
            if by_branch.get(branch):
                lines.append(f"{label}: {'; '.join(by_branch[branch])}.")
        features = self.features(disease)
        by_label: dict[str, list[str]] = {}
        for h in features:
            by_label.setdefault(frequency_label(disease.phenotypes[h]), []).append(terms[h].name)
        for label, names in by_label.items():
            for i in range(0, len(names), FEATURES_PER_LINE):
                lines.append(f"Phenotypes of {disease.name}, {label}: {'; '.join(names[i : i + FEATURES_PER_LINE])}.")
        absent = [terms[h].name for h in disease.excluded] + [
            terms[h].name for h, f in disease.phenotypes.items() if f == 0 and self.branch(h) == "phenotype"
        ]
        if absent:
            lines.append(f"Not observed in {disease.name}: {'; '.join(sorted(set(absent)))}.")
        key = [h for h in features if terms[h].definition][:KEY_PHENOTYPES]
        if key:
            lines.append(f"Key phenotypes of {disease.name} explained:")
            lines.extend(f"- {terms[h].name}: {terms[h].definition}" for h in key)
        return lines

    def term_lines(self, term: Term) -> list[str]:
        """The HPO term document."""
        terms = self.snapshot.terms
        lines = [f"{term.name} ({term.id}) is a term of the Human Phenotype Ontology."]
        if term.definition:
            lines.append(f"Definition: {term.definition}")
        if term.synonyms:
            lines.append(f"Synonyms: {'; '.join(term.synonyms)}.")
        if term.parents:
            lines.append(f"It is a kind of: {'; '.join(terms[p].name for p in term.parents)}.")
        return lines

    def chunks(self, min_words: int = 100) -> Iterator[dict]:
        """All chunks: diseases then terms, each in id order."""
        for disease in self.snapshot.diseases.values():
            yield from chunk_document(
                f"disease:{disease.id}", disease.name, self.disease_lines(disease), disease.source, min_words
            )
        for term in self.snapshot.terms.values():
            yield from chunk_document(f"term:{term.id}", term.name, self.term_lines(term), "HPO", min_words)


def chunk_document(doc_id: str, title: str, lines: list[str], source: str, min_words: int = 100) -> Iterator[dict]:
    """Pack whole lines into chunks of >= ``min_words`` words; a short tail joins the previous chunk."""
    groups: list[list[str]] = []
    count = min_words
    for line in lines:
        if count >= min_words:
            groups.append([])
            count = 0
        groups[-1].append(line)
        count += len(line.split())
    if len(groups) > 1 and count < min_words:
        groups[-2].extend(groups.pop())
    for i, group in enumerate(groups):
        text = "\n".join(group if i == 0 else [f"{title} (continued):", *group])
        yield {"id": f"{doc_id}#{i}", "doc_id": doc_id, "title": title, "text": text, "source": source}

