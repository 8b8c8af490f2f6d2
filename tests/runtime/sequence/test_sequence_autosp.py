"""AutoSP for multimodal models (deepspeed.sequence.autosp_vit / autosp_fusion / auto_sp):
2 gloo ranks, each holding a slice of the patches, give what one process computes on the
whole sequence: the output slice and every gradient.

Reference (in each rank's process, on the same seeded tensors): the wrapped module applied
to the whole input, with the loss sum over ranks r of (rank r's output slice * w_r). Then
rank r's patch (or visual token) gradient must equal the reference's gradient for rank r's
positions, and the replicated things (the [CLS] copy, the text embeddings, the attention's
and the projection's weights), whose per-rank gradients are shares, must sum over the
group to the reference gradient. Cases: [CLS] or none, 8 patches (4 + 4) and 5 (3 + 2),
an attention returning a tuple; the three fusion splices with a real projection; and
auto_wrap_model_for_sp's choices. In one process: the splices and the detector's registry
equal DeepSpeed 0.19.8's on the same inputs (tests/data/ds_autosp.pt, written by
scripts/make_ds_autosp_fixtures.py from the calls in scripts/autosp_cases.py), and where
DeepSpeed fails inside torch, or silently drops an unpaired token, ours refuses in one line.
"""
import pytest
import torch

from dist_harness import run_function
from repo_paths import DATA
from script_modules import load_script

CASES = load_script("autosp_cases")  # the calls scripts/make_ds_autosp_fixtures.py records
DS = torch.load(DATA / "ds_autosp.pt")


def _vit_attention(hidden=8, heads=2, tuple_out=False):
    import torch

    class ViTAttention(torch.nn.Module):  # non-causal softmax attention over hidden states
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(hidden, 3 * hidden)
            self.proj = torch.nn.Linear(hidden, hidden)

        def forward(self, x, scale=1.0):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, heads, hidden // heads).permute(2, 0, 3, 1, 4)
            p = (q @ k.transpose(-1, -2) * scale / (hidden // heads) ** 0.5).softmax(-1)
            out = self.proj((p @ v).transpose(1, 2).reshape(b, s, hidden))
            return (out, p) if tuple_out else out

    torch.manual_seed(3)
    return ViTAttention()


def _split(n, sp, r):
    base, extra = divmod(n, sp)
    start = r * base + min(r, extra)
    return start, base + (1 if r < extra else 0)


def _sum_over_group(t, group):
    from dslaunch.runtime import comm

    t = t.clone()
    comm.all_reduce(t, group=group)
    return t


def vit_case(group, sp, r, num_patches, has_cls, tuple_out):
    import copy

    import torch

    from dslaunch.runtime.sequence.vit_attention import UlyssesSPViTAttention

    bs, hidden, head = 2, 8, 1 if has_cls else 0
    g = torch.Generator().manual_seed(11)
    full = torch.randn(bs, head + num_patches, hidden, generator=g)
    lens = [_split(num_patches, sp, q)[1] for q in range(sp)]
    weights = [torch.randn(bs, head + n, hidden, generator=g) for n in lens]  # rank q's loss weights
    attn = _vit_attention(hidden, tuple_out=tuple_out)
    ref_attn = copy.deepcopy(attn)

    x = full.clone().requires_grad_()
    ref = ref_attn(x, scale=0.5)
    ref = ref[0] if tuple_out else ref
    loss = 0
    for q in range(sp):
        s, n = _split(num_patches, sp, q)
        piece = torch.cat([ref[:, :head], ref[:, head + s:head + s + n]], dim=1)
        loss = loss + (piece * weights[q]).sum()
    loss.backward()

    start, n = _split(num_patches, sp, r)
    local = torch.cat([full[:, :head], full[:, head + start:head + start + n]], dim=1).requires_grad_()
    out = UlyssesSPViTAttention(attn, group, has_cls_token=has_cls)(local, scale=0.5)
    if tuple_out:
        assert isinstance(out, tuple) and out[1].shape[-1] == head + num_patches  # the extras come back whole
        out = out[0]
    (out * weights[r]).sum().backward()

    want = torch.cat([ref[:, :head], ref[:, head + start:head + start + n]], dim=1)
    diffs = {"out": (out - want).abs().max(),
             "patch grad": (local.grad[:, head:] - x.grad[:, head + start:head + start + n]).abs().max()}
    if has_cls:
        diffs["cls grad"] = (_sum_over_group(local.grad[:, :1], group) - x.grad[:, :1]).abs().max()
    for (name, p), ref_p in zip(attn.named_parameters(), ref_attn.parameters()):
        diffs[name] = (_sum_over_group(p.grad, group) - ref_p.grad).abs().max()
    return {k: float(v) for k, v in diffs.items()}


def fusion_case(group, sp, r, kind):
    import copy

    import torch

    from dslaunch.runtime.sequence import fusion

    bs, vit_hidden, hidden, text_len = 2, 6, 4, 11
    g = torch.Generator().manual_seed(5)
    ids = torch.zeros(bs, text_len, dtype=torch.long)
    if kind == "llava":  # two images in sample 0, one in sample 1: fused lengths differ
        num_visual = 6
        ids[0, 1], ids[0, 7], ids[1, 4] = -200, -200, -200
        make = lambda proj: fusion.LlavaFusionAdapter(proj, group, image_token_id=-200)  # noqa: E731
    elif kind == "internvl":
        num_visual = 5
        ids[:, 3:8] = 92546
        make = lambda proj: fusion.InternVLFusionAdapter(proj, group, image_token_id=92546)  # noqa: E731
    else:
        num_visual = 5
        ids[:, 2], ids[:, 8] = 151652, 151653
        make = lambda proj: fusion.Qwen2VLFusionAdapter(proj, group, vision_start_token_id=151652,  # noqa: E731
                                                        vision_end_token_id=151653)
    visual = torch.randn(bs, num_visual, vit_hidden, generator=g)
    text = torch.randn(bs, text_len, hidden, generator=g)
    torch.manual_seed(9)
    proj = torch.nn.Linear(vit_hidden, hidden)
    ref_proj = copy.deepcopy(proj)

    rv, rt = visual.clone().requires_grad_(), text.clone().requires_grad_()
    ref_adapter = make(ref_proj)
    fused = ref_adapter._splice_visual_into_text(rt, ref_proj(rv), ids)
    pad = (-fused.shape[1]) % sp
    fused = torch.nn.functional.pad(fused, (0, 0, 0, pad))
    chunk = fused.shape[1] // sp
    w = torch.randn(fused.shape, generator=g)
    (fused * w).sum().backward()

    start, n = _split(num_visual, sp, r)
    lv = visual[:, start:start + n].clone().requires_grad_()
    lt = text.clone().requires_grad_()
    out = make(proj)(lv, lt, ids)
    mine = slice(r * chunk, (r + 1) * chunk)
    (out * w[:, mine]).sum().backward()
    diffs = {"out": (out - fused[:, mine]).abs().max(),
             "visual grad": (lv.grad - rv.grad[:, start:start + n]).abs().max(),
             "text grad": (_sum_over_group(lt.grad, group) - rt.grad).abs().max()}
    for (name, p), ref_p in zip(proj.named_parameters(), ref_proj.parameters()):
        diffs[name] = (_sum_over_group(p.grad, group) - ref_p.grad).abs().max()
    return {k: float(v) for k, v in diffs.items()}


def auto_wrap_case(group):
    import torch

    from dslaunch.runtime.sequence.autowrap import auto_wrap_model_for_sp
    from dslaunch.runtime.sequence.vit_attention import UlyssesSPViTAttention

    CLIPAttention = type("CLIPAttention", (torch.nn.Identity,), {})
    SiglipAttention = type("SiglipAttention", (torch.nn.Identity,), {})
    LlamaAttention = type("LlamaAttention", (torch.nn.Identity,), {})
    model = torch.nn.Module()
    model.vision = torch.nn.ModuleList([CLIPAttention(), SiglipAttention()])
    model.mm_projector = torch.nn.Linear(2, 2)
    model.decoder = torch.nn.Sequential(LlamaAttention())
    assert auto_wrap_model_for_sp(model, group) is model
    a, b = model.vision
    return [type(a).__name__, a.has_cls_token, type(a.attn).__name__, type(b).__name__, b.has_cls_token,
            type(model.decoder[0]).__name__, isinstance(a, UlyssesSPViTAttention)]


def autosp_body():
    from dslaunch.runtime import comm
    from dslaunch.runtime.parallel import MeshDims, ProcessMesh, topology_for

    world = comm.get_world_size()
    mesh = ProcessMesh(topology_for(MeshDims.for_world(world, sequence=world)))
    group, sp, r = mesh.group("sequence"), mesh.size("sequence"), mesh.rank("sequence")
    results = {}
    for patches, has_cls, tuple_out in VIT_CASES:
        results[("vit", patches, has_cls, tuple_out)] = vit_case(group, sp, r, patches, has_cls, tuple_out)
    for kind in FUSION_CASES:
        results[("fusion", kind)] = fusion_case(group, sp, r, kind)
    results["auto_wrap"] = auto_wrap_case(group)
    return results


VIT_CASES = [(8, True, False), (8, False, True), (5, True, True), (5, False, False)]  # patches, cls, tuple
FUSION_CASES = ["llava", "internvl", "qwen2vl"]


def test_autosp_two_ranks_equal_one_process():
    results = run_function(autosp_body, nprocs=2, timeout=180)
    for rank, per_case in enumerate(results):
        assert per_case.pop("auto_wrap") == ["UlyssesSPViTAttention", True, "CLIPAttention", "UlyssesSPViTAttention",
                                             False, "LlamaAttention", True], rank
        assert len(per_case) == len(VIT_CASES) + len(FUSION_CASES)
        for case, diffs in per_case.items():
            assert max(diffs.values()) < 1e-5, (rank, case, diffs)



def test_recorded_from_deepspeed_0_19_8():
    assert DS["deepspeed"] == "0.19.8"


@pytest.mark.parametrize("case", sorted(DS["splices"]))
def test_splices_put_visual_tokens_where_deepspeed_does(case):
    """Each splice against DeepSpeed's for the same inputs; where DeepSpeed fails inside
    torch (more placeholders than visual tokens: a RuntimeError), one FusionSpliceError line."""
    from dslaunch.runtime.sequence import fusion

    adapter, text, visual, ids = CASES.splice_inputs(fusion)[case]
    want = DS["splices"][case]
    if isinstance(want, str):
        assert want == "RuntimeError"
        with pytest.raises(fusion.FusionSpliceError, match="visual placeholders but only"):
            adapter._splice_visual_into_text(text, visual, ids)
        return
    got = adapter._splice_visual_into_text(text, visual, ids)
    assert got.shape == want.shape and torch.equal(got, want)


def test_detection_is_deepspeeds():
    from dslaunch.runtime.sequence import autowrap

    assert CASES.run_detector(autowrap) == DS["detector"]


def test_splices_refuse_placeholders_that_do_not_match():
    import torch

    from dslaunch.runtime.sequence import fusion

    text, visual = torch.zeros(1, 5, 2), torch.zeros(1, 2, 2)
    intern = CASES._adapter(fusion.InternVLFusionAdapter, image_token_id=9)
    with pytest.raises(fusion.FusionSpliceError, match="sample 0 has 3 visual placeholders but only 2 visual tokens"):
        intern._splice_visual_into_text(text, visual, torch.tensor([[9, 9, 9, 0, 0]]))
    qwen = CASES._adapter(fusion.Qwen2VLFusionAdapter, vision_start_token_id=5, vision_end_token_id=6)
    with pytest.raises(fusion.FusionSpliceError, match=r"vision_start at \[0\] and vision_end at \[\]"):
        qwen._splice_visual_into_text(text, visual, torch.tensor([[5, 0, 0, 0, 0]]))
    llava = CASES._adapter(fusion.LlavaFusionAdapter, image_token_id=-200)
    with pytest.raises(fusion.FusionSpliceError, match="3 image placeholders but its 2 visual tokens make 2 chunks"):
        llava._splice_visual_into_text(text, visual, torch.tensor([[-200, -200, -200, 0, 0]]))
    with pytest.raises(fusion.FusionSpliceError, match="input_ids"):
        llava._splice_visual_into_text(text, visual, torch.zeros(1, 4, dtype=torch.long))


def test_auto_wrap_refuses_a_model_without_known_attention():
    import torch

    from dslaunch.runtime.sequence.autowrap import auto_wrap_model_for_sp, detect_model_sp_info

    with pytest.raises(ValueError, match="no known attention class"):
        auto_wrap_model_for_sp(torch.nn.Sequential(torch.nn.Linear(2, 2)), None)
    info = detect_model_sp_info(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert info.vit_attn_modules == [] and info.vision_projection_module is None
