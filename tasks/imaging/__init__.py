"""Synthetic medical images with known lesions, the questions asked about them, and an image-caption corpus (CDIR).

Three image families, all ``IMAGE_SIZE`` x ``IMAGE_SIZE`` (448) pixels, drawn with numpy/scipy from a per-image seed:

- ``chest_xray``: a grayscale frontal chest radiograph (lungs, ribs, clavicles, spine, heart, vessel markings, noise).
- ``bone_xray``: a grayscale radiograph of both femora (cortex, trabecular medulla, soft tissue, air).
- ``pathology``: an RGB H&E-like tissue section (eosinophilic stroma, hematoxylin nuclei, clear spaces).

Each image carries one *target* lesion (what the questions ask about) and 0-2 other lesions of other kinds in other
regions. Every lesion kind is an HPO phenotype looked up in the snapshot by name (:data:`FINDINGS`), so the
knowledge base holds its description (``term:HP:...``) and the diseases annotated with it (``disease:...``):
answering needs the image (which finding is where) and retrieval (what it means, which condition it belongs to).

Exactness. A lesion is drawn as an integer change to the pixels of the finished background; its mask is, by
construction, exactly the set of pixels whose value it changes (after rounding and clipping), and its box is that
mask's bounding box in pixel-edge coordinates ``[x0, y0, x1, y1]`` (``x1``/``y1`` exclusive): ``image[y0:y1, x0:x1]``
is the tightest crop holding the lesion. :func:`render_case` re-creates any image, its masks and the lesion-free
background from the case's spec (stored in every task's ``metadata["case"]``).

Size strata. ``small`` lesions span 6-12 px at full resolution, i.e. at most 2.25 px at the model input of
``INPUT_SIZE`` (84) px: they need a zoom-in (a crop of the full-resolution image) to be recognised. ``large``
lesions span 28-72 px (5-14 px at the input size) and are visible without one. (Spans are the longer side of the
box.)

Regions. Questions name the lesion's cell of a 3 x 3 grid over the image, in image coordinates ("the upper right of
the image"); every lesion box lies inside one cell (with a margin), and different lesions of an image occupy
different cells, so each question has one answer.

Questions (one case = one image; see :class:`ImagingTaskBuilder`):

- ``finding_mcq``: "What finding is present in the <region> of the image?" -> 4 HPO finding names of the same image
  family (the image's other findings first among the distractors), answer a letter.
- ``finding_open``: the same question, open-ended; the answer is the HPO term name, references add its synonyms.
- ``condition_mcq``: "The lesion in the <region> ... is a recognised feature of which of these conditions?" -> 4
  diseases; the answer is annotated in HPO with the finding (or a descendant), no distractor is. Diseases are split
  into train and test before any question is made (as in the HPO world), so a test condition never appears in
  training and can only be answered by retrieving. Findings annotated to no eligible disease get no such question.

Image paths in task files are relative to the world directory (POSIX, e.g. ``images/train/train-00000.png``); use
:func:`tasks.schema.resolve_image_paths` to make them absolute. The images attach to the first user message, in order; the message
text holds no placeholder token.
"""
from tasks.imaging.cases import CaseSpec, LesionSpec, RenderedCase, cell_edges, mask_box, render_case
from tasks.imaging.questions import (PNG_COMPRESS_LEVEL, CaseResult, ImagingTaskBuilder, case_caption,
                                     render_and_save, system_message)
from tasks.imaging.world import FINDINGS, FINDINGS_BY_KEY, IMAGE_SIZE, INPUT_SIZE, MODALITIES, Finding, Modality

__all__ = ["FINDINGS", "FINDINGS_BY_KEY", "IMAGE_SIZE", "INPUT_SIZE", "MODALITIES", "PNG_COMPRESS_LEVEL", "CaseResult",
           "CaseSpec", "Finding", "ImagingTaskBuilder", "LesionSpec", "Modality", "RenderedCase", "case_caption",
           "cell_edges", "mask_box", "render_and_save", "render_case", "system_message"]
