"""The calls of DeepSpeed's AutoSP pieces that tests/runtime/sequence/test_sequence_autosp.py
compares with DeepSpeed 0.19.8: run against DeepSpeed's modules by
scripts/make_ds_autosp_fixtures.py (recorded in tests/data/ds_autosp.pt) and against
dslaunch's by the test.

- the fusion splices (`_splice_visual_into_text`, pure: one process, no group): which
  visual token lands where, for single and multiple images, samples without one, and a
  Llava split torch.chunk makes uneven; the inputs DeepSpeed fails on (too few visual
  tokens) are recorded as the exception's class name;
- the detector's registry and its answer on a model of registered class names.
`fusion`, `detector`: the modules (DeepSpeed's autosp_fusion / autosp_detector or ours).
"""
import torch

LLAVA, INTERNVL, QWEN = -200, 92546, (151652, 151653)


def _adapter(cls, **attrs):
    """An adapter without a process group: the splice reads only these attributes."""
    adapter = cls.__new__(cls)
    torch.nn.Module.__init__(adapter)
    for k, v in attrs.items():
        setattr(adapter, k, v)
    return adapter


def _ids(rows):
    return torch.tensor(rows, dtype=torch.long)


def _splice_cases(fusion):
    llava = _adapter(fusion.LlavaFusionAdapter, image_token_id=LLAVA)
    intern = _adapter(fusion.InternVLFusionAdapter, image_token_id=INTERNVL)
    qwen = _adapter(fusion.Qwen2VLFusionAdapter, vision_start_token_id=QWEN[0], vision_end_token_id=QWEN[1])
    x, o = LLAVA, 0
    s, e = QWEN
    c = INTERNVL
    return {  # name: (adapter, input_ids, visual tokens per sample)
        "llava_one_image": (llava, _ids([[o, x, o, o, o, o]]), 4),
        "llava_two_images_and_none": (llava, _ids([[x, o, o, x, o, o], [o] * 6]), 6),
        "llava_uneven_chunks": (llava, _ids([[o, x, o, x, o, o]]), 5),  # torch.chunk: 3 and 2
        "llava_no_image": (llava, _ids([[o] * 6]), 2),
        "internvl_two_runs": (intern, _ids([[o, c, c, o, c, o], [c, o, o, o, o, c]]), 3),
        "internvl_more_visual_than_places": (intern, _ids([[o, c, c, o, o, o]]), 4),
        "internvl_too_few_visual": (intern, _ids([[c, c, c, c, o, o]]), 2),
        "qwen2vl_two_pairs": (qwen, _ids([[s, o, e, s, o, o, e, o]]), 3),
        "qwen2vl_empty_pair": (qwen, _ids([[o, s, e, o, o, o, o, o]]), 2),
        "qwen2vl_none": (qwen, _ids([[o] * 8]), 2),
        "qwen2vl_too_few_visual": (qwen, _ids([[s, o, o, o, e, o, o, o]]), 2),
    }


def splice_inputs(fusion):
    """{case: (adapter, text_embeds, visual_embeds, input_ids)}, the tensors seeded per case."""
    out = {}
    for name, (adapter, ids, num_visual) in _splice_cases(fusion).items():
        g = torch.Generator().manual_seed(len(name))
        text = torch.randn(ids.shape[0], ids.shape[1], 3, generator=g)
        visual = torch.randn(ids.shape[0], num_visual, 3, generator=g)
        out[name] = (adapter, text, visual, ids)
    return out


def run_splices(fusion):
    """{case: the fused tensor, or the class name of what was raised}."""
    out = {}
    for name, (adapter, text, visual, ids) in splice_inputs(fusion).items():
        try:
            out[name] = adapter._splice_visual_into_text(text, visual, ids)
        except Exception as exc:  # noqa: BLE001  the class is what is recorded
            out[name] = type(exc).__name__
    return out


def run_detector(detector):
    """DeepSpeed's registry and detect_model_sp_info's answer on a model of its class names."""
    model = torch.nn.Module()
    for i, cls_name in enumerate(["CLIPAttention", "SiglipAttention", "LlamaAttention", "Qwen2Attention"]):
        setattr(model, f"layer{i}", type(cls_name, (torch.nn.Identity,), {})())
    model.vision = torch.nn.Module()
    model.vision.mm_projector = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.multi_modal_projector = torch.nn.Linear(2, 2)
    info = detector.detect_model_sp_info(model)
    return {"vit_has_cls": dict(sorted(detector._VIT_HAS_CLS_TOKEN.items())),
            "vit": sorted(detector._VIT_ATTN_CLASSNAMES), "llm": sorted(detector._LLM_ATTN_CLASSNAMES),
            "proj_keywords": list(detector._VISION_PROJ_KEYWORDS),
            "found_vit": [n for n, _ in info.vit_attn_modules], "found_llm": [n for n, _ in info.llm_attn_modules],
            "found_proj": info.vision_projection_module[0]}
