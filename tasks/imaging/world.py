"""The imaging world's vocabulary: image geometry, modalities and their regions, and the findings they can show."""
from __future__ import annotations

from dataclasses import dataclass, field


IMAGE_SIZE = 448
INPUT_SIZE = 84  # a Qwen2-VL policy's 2 x 2-merged tokens of 28 px are then the 3 x 3 cells questions name
GRID = 3
BACKGROUND_RANGE = (30, 225)
LETTERS = "ABCD"

SIZE_STRATA = {"small": (6, 12), "large": (28, 72)}
ROW_NAMES = ("upper", "middle", "lower")
COL_NAMES = ("left", "central", "right")


def region_name(row: int, col: int) -> str:
    """The 3 x 3 cell in words: 'upper left', 'center', 'lower central', ..."""
    if row == 1 and col == 1:
        return "center"
    return f"{ROW_NAMES[row]} {COL_NAMES[col]}"


@dataclass(frozen=True)
class Modality:
    key: str
    label: str  # in a question: "This is a {label}."
    channels: int
    cells: tuple[tuple[int, int], ...]  # (row, col) cells lesions may occupy


_SIDE_CELLS = tuple((r, c) for r in range(GRID) for c in (0, GRID - 1))  # lungs / femora: left and right columns
MODALITIES = {
    "chest_xray": Modality("chest_xray", "frontal chest radiograph", 1, _SIDE_CELLS),
    "bone_xray": Modality("bone_xray", "radiograph of both femora", 1, _SIDE_CELLS),
    "pathology": Modality("pathology", "H&E-stained tissue section", 3,
                          tuple((r, c) for r in range(GRID) for c in range(GRID))),
}


@dataclass(frozen=True)
class Finding:
    """A lesion kind: how it is drawn (``key``), where (``modality``), what HPO calls it, which sizes it comes in."""

    key: str
    modality: str
    hpo_name: str
    strata: tuple[str, ...]
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)  # overrides SIZE_STRATA per stratum
    looks: str = ""  # what it looks like, for captions

    def size_range(self, stratum: str) -> tuple[int, int]:
        return self.sizes.get(stratum, SIZE_STRATA[stratum])


FINDINGS: tuple[Finding, ...] = (
    Finding("nodule", "chest_xray", "Pulmonary nodule", ("small", "large"), {"large": (28, 48)},
            "a round soft-tissue opacity"),
    Finding("calcified_nodule", "chest_xray", "Calcified pulmonary nodule", ("small", "large"), {"large": (28, 36)},
            "a very dense, sharply marginated round opacity"),
    Finding("cyst", "chest_xray", "Pulmonary cyst", ("small", "large"), {"large": (28, 56)},
            "a round lucency with a thin regular wall"),
    Finding("abscess", "chest_xray", "Lung abscess", ("large",), {"large": (32, 60)},
            "a thick-walled cavity with an air-fluid level"),
    Finding("mass", "chest_xray", "Neoplasm of the lung", ("large",), {"large": (50, 72)},
            "a large lobulated, spiculated opacity"),
    Finding("fracture", "bone_xray", "Long-bone fracture", ("small", "large"), {"large": (40, 70)},
            "a lucent fracture line through the cortex"),
    Finding("bone_cyst", "bone_xray", "Bone cyst", ("small", "large"), {"large": (28, 44)},
            "a well-defined oval medullary lucency with a thin sclerotic rim"),
    Finding("osteoma", "bone_xray", "Osteoma", ("small", "large"), {"large": (28, 40)},
            "a dense bony outgrowth from the cortex"),
    Finding("osteolysis", "bone_xray", "Osteolysis", ("small", "large"), {"large": (28, 48)},
            "a patch of moth-eaten bone destruction"),
    Finding("carcinoma", "pathology", "Carcinoma", ("small", "large"), {"large": (32, 64)},
            "a cluster of enlarged, crowded, hyperchromatic atypical nuclei"),
    Finding("necrosis", "pathology", "Hepatic necrosis", ("small", "large"), {"large": (36, 72)},
            "a pale eosinophilic patch without intact nuclei, with nuclear debris"),
    Finding("granuloma", "pathology", "Granuloma", ("large",), {"large": (40, 72)},
            "a round aggregate of pale epithelioid histiocytes rimmed by lymphocytes"),
    Finding("calcification", "pathology", "Ectopic calcification", ("small", "large"), {"large": (28, 44)},
            "a dense dark-purple laminated calcium deposit"),
    Finding("steatosis", "pathology", "Macrovesicular hepatic steatosis", ("small", "large"), {"large": (32, 60)},
            "a group of large clear fat vacuoles"),
)
FINDINGS_BY_KEY = {f.key: f for f in FINDINGS}
