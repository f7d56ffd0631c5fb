"""difrl.eval.fd / extractors / reference: Fréchet distance against closed forms, scipy and torchmetrics; KID
against torchmetrics and the direct formula; cached reference statistics; the Inception / CLIP / DINOv2 / module
extractors, all offline."""

import math

import numpy as np
import pytest
import torch

from difrl.eval.extractors import (IMAGENET_MEAN, IMAGENET_STD, ClipExtractor, DinoV2Extractor, EvalConfigError,
                                   InceptionExtractor, ModuleExtractor, extract_features, save_random_inception_weights,
                                   state_dict_sha256)
from difrl.eval.fd import frechet_distance_from_stats, kid, mmd2_unbiased
from difrl.eval.metrics import frechet_distance, sqrt_psd
from difrl.eval.reference import (STATS_FORMAT, FeatureStats, StatsAccumulator, fid_report, reference_stats,
                                  reference_stats_path, stats_of)
from difrl.utils.images import to_uint8
from difrl.utils.io import sha256_file
from tolerances import FP32_REORDER


def _spd(d: int, seed: int, cond: float = 50.0) -> torch.Tensor:
    """A random symmetric positive definite [d, d] float64 matrix with eigenvalues in [1/cond, 1]."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    w = torch.logspace(0, -math.log10(cond), d, dtype=torch.float64)
    return (q * w) @ q.T


# --- Fréchet distance -------------------------------------------------------------------------------------------

def test_fd_closed_form_commuting_covariances():
    # S_a = R diag(a) R^T, S_b = R diag(b) R^T commute, so FD = |mu_a - mu_b|^2 + sum (sqrt(a) - sqrt(b))^2 exactly
    d = 16
    g = torch.Generator().manual_seed(0)
    r, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    a = torch.rand(d, generator=g, dtype=torch.float64) * 3 + 0.1
    b = torch.rand(d, generator=g, dtype=torch.float64) * 3 + 0.1
    mu_a, mu_b = torch.randn(d, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64)
    got = frechet_distance_from_stats((mu_a, (r * a) @ r.T), (mu_b, (r * b) @ r.T))
    want = float(((mu_a - mu_b) ** 2).sum() + ((a.sqrt() - b.sqrt()) ** 2).sum())
    assert got == pytest.approx(want, rel=1e-10)  # float64 eigendecompositions: ~1e-13 relative, kept apart by 1e3
    # identical distributions: 0 (up to round-off); a scaled copy: (1 - c)^2 tr S
    s = _spd(d, 1)
    assert abs(frechet_distance_from_stats((mu_a, s), (mu_a, s))) < 1e-10  # float64 round-off of a sqrtm
    assert frechet_distance_from_stats((mu_a, s), (mu_a, 4 * s)) == pytest.approx(float(torch.trace(s)), rel=1e-10)


def test_sqrtm_and_fd_match_scipy():
    import scipy.linalg

    m = _spd(32, 2)
    assert np.abs(sqrt_psd(m).numpy() - scipy.linalg.sqrtm(m.numpy()).real).max() < 1e-10  # float64, two algorithms
    # general (non-commuting) covariances: the pytorch-fid / EDM2 form with scipy.linalg.sqrtm(S_a S_b)
    sa, sb = _spd(32, 3), _spd(32, 4, cond=1e3)
    mu_a, mu_b = torch.zeros(32, dtype=torch.float64), torch.full((32,), 0.1, dtype=torch.float64)
    covmean = scipy.linalg.sqrtm(sa.numpy() @ sb.numpy())
    want = float(((mu_a - mu_b) ** 2).sum()) + float(np.trace(sa.numpy() + sb.numpy() - 2 * covmean.real))
    assert frechet_distance_from_stats((mu_a, sa), (mu_b, sb)) == pytest.approx(want, rel=1e-9)  # float64, as above


def test_fd_of_samples_approaches_the_gaussians_fd():
    g = torch.Generator().manual_seed(5)
    d, n = 3, 40000
    sa, sb = _spd(d, 6), 2.0 * _spd(d, 7)
    mu_b = torch.tensor([0.5, -0.5, 0.25], dtype=torch.float64)
    xa = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(sa).T
    xb = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(sb).T + mu_b
    want = frechet_distance_from_stats((torch.zeros(d, dtype=torch.float64), sa), (mu_b, sb))
    got = fid_report(xa, xb, kid_subsets=1, kid_subset_size=10)["fd"]
    assert got == pytest.approx(want, rel=0.03)  # sampling error of 40k draws (~1%)


def test_stats_reproduce_metrics_frechet_distance_bit_for_bit():
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(300, 12, generator=g), torch.randn(200, 12, generator=g) * 1.3 + 0.2
    assert frechet_distance_from_stats(stats_of(a), stats_of(b)) == frechet_distance(a, b)
    # the streaming accumulator (uneven batches) agrees with the two-pass statistics to round-off
    acc = StatsAccumulator()
    for chunk in torch.split(a, [1, 7, 100, 192]):
        acc.add(chunk)
    s, ref = acc.stats(), stats_of(a)
    assert s.n == 300
    np.testing.assert_allclose(s.mu, ref.mu, rtol=0, atol=1e-14)  # float64 sums of 300 O(1) terms in other chunks:
    np.testing.assert_allclose(s.sigma, ref.sigma, rtol=0, atol=1e-13)  # ~300 x 1e-16 at most


# --- KID --------------------------------------------------------------------------------------------------------

def _mmd2_loops(x: np.ndarray, y: np.ndarray, degree=3, coef=1.0) -> float:
    """The unbiased MMD^2 written out as sums over index pairs (Gretton et al. 2012, eq. 3)."""
    gamma = 1.0 / x.shape[1]
    k = lambda u, v: (gamma * float(u @ v) + coef) ** degree
    m, n = len(x), len(y)
    sxx = sum(k(x[i], x[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    syy = sum(k(y[i], y[j]) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    sxy = sum(k(x[i], y[j]) for i in range(m) for j in range(n)) / (m * n)
    return sxx + syy - 2 * sxy


def test_kid_full_subset_equals_the_direct_formula():
    g = torch.Generator().manual_seed(9)
    x, y = torch.randn(25, 6, generator=g, dtype=torch.float64), torch.randn(30, 6, generator=g, dtype=torch.float64)
    y[:, 0] += 0.7
    assert mmd2_unbiased(x, y) == pytest.approx(_mmd2_loops(x.numpy(), y.numpy()), rel=1e-12)  # float64, reordered
    # one subset holding all rows (equal sizes): the permutation cannot matter
    mean, std = kid(x, y[:25], subsets=1, subset_size=25)
    assert mean == pytest.approx(_mmd2_loops(x.numpy(), y[:25].numpy()), rel=1e-12) and std == 0.0
    with pytest.raises(ValueError, match="subset_size"):
        kid(x, y, subset_size=26)


# --- the digits world against torchmetrics ----------------------------------------------------------------------

class _DoubleFeatures(torch.nn.Module):
    """The digits classifier's 64-d penultimate features in float64 (so torchmetrics' KID runs in float64 too)."""

    num_features = 64

    def __init__(self, clf):
        super().__init__()
        self.clf = clf

    def forward(self, x):
        return self.clf.features(x).double()


@pytest.fixture(scope="module")
def digits():
    from difrl.rewards.digits import load_classifier
    from difrl.worlds.digits import load_split

    split = load_split()
    real = split["x_test"]  # [360, 1, 8, 8] in [0, 1]
    g = torch.Generator().manual_seed(11)
    # "generated-like": training digits, blurred a little and noised (a distribution close to, not equal to, real)
    x = split["x_train"][:500]
    blur = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(x, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
    gen = (0.6 * x + 0.4 * blur + 0.05 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    return load_classifier(), real, gen


@pytest.mark.filterwarnings("ignore:Metric `Kernel Inception Distance` will save")
def test_digits_fd_and_kid_match_torchmetrics(digits, tmp_path):
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.kid import KernelInceptionDistance

    from difrl.worlds.digits import FEATURE_EXTRACTOR

    clf, real, gen = digits
    ext = ModuleExtractor(clf, FEATURE_EXTRACTOR, method="features", num_features=64)
    ref = reference_stats(ext, real, tmp_path, "digits-test", 8, batch_size=100)
    gen_feats = extract_features(ext, gen, batch_size=128)
    rep = fid_report(gen_feats, ref, ext, kid_subsets=1, kid_subset_size=10)
    # the digits world's own number (difrl.worlds.digits.image_metrics: frechet_distance on clf.features)
    world_fd = frechet_distance(clf.features(gen), clf.features(real))
    # streamed reference statistics vs two-pass ones differ by ~1e-13 in sigma; dead ReLU units make the covariance
    # singular, and the square root of its ~0 eigenvalues turns that into ~1e-8 relative in FD
    assert rep["fd"] == pytest.approx(world_fd, rel=1e-6)

    # torchmetrics with the same module as `feature=` (it reads num_features; custom modules get the images as-is)
    tm = FrechetInceptionDistance(feature=ext, normalize=True)
    tm.update(real, real=True)
    tm.update(gen, real=False)
    tm_fd = float(tm.compute())
    assert abs(rep["fd"] - tm_fd) / tm_fd < 1e-6, (rep["fd"], tm_fd)  # as above: the same statistics, another sqrtm

    # KID: the same subsets (torchmetrics draws from the global generator, real first) and the same estimator
    tk = KernelInceptionDistance(feature=_DoubleFeatures(clf), subsets=20, subset_size=100)
    tk.update(real, real=True)
    tk.update(gen, real=False)
    torch.manual_seed(123)
    tk_mean, tk_std = (float(v) for v in tk.compute())
    mean, std = kid(clf.features(real), clf.features(gen), subsets=20, subset_size=100, seed=123)
    assert mean == pytest.approx(tk_mean, rel=1e-9) and std == pytest.approx(tk_std, rel=1e-9)  # float64, reordered
    assert mean > 0


def test_fid_report_fields_and_feature_space_check(digits, tmp_path):
    clf, real, gen = digits
    ext = ModuleExtractor(clf, "digits-penultimate", method="features")
    ref = reference_stats(ext, real, tmp_path, "digits-test", 8, keep_features=True)
    rep = fid_report(extract_features(ext, gen), ref, ext, kid_subsets=5, kid_subset_size=100)
    assert set(rep) == {"metric", "fd", "kid_mean", "kid_std", "kid_subsets", "kid_subset_size", "extractor",
                        "weights_sha256", "resize_mode", "dim", "n_gen", "n_ref", "ref_stats_sha256"}
    assert (rep["n_gen"], rep["n_ref"], rep["dim"], rep["kid_subset_size"]) == (500, 360, 64, 100)
    assert rep["weights_sha256"] == state_dict_sha256(clf) and rep["ref_stats_sha256"] == ref.sha256
    # statistics only (no raw generated features): no KID
    assert "kid_mean" not in fid_report(stats_of(extract_features(ext, gen)), ref, ext)
    other = ModuleExtractor(torch.nn.Linear(64, 64), "digits-penultimate")  # same name, other weights
    with pytest.raises(ValueError, match="two feature spaces"):
        fid_report(extract_features(ext, gen), ref, other)


# --- statistics files and the cache -----------------------------------------------------------------------------

def test_feature_stats_round_trip_and_hash(tmp_path):
    feats = torch.randn(50, 5, generator=torch.Generator().manual_seed(12))
    st = stats_of(feats, provenance={"dataset": "x", "note": "ü"}, keep_features=True)
    h = st.sha256
    p = st.save(tmp_path / "a.npz")
    back = FeatureStats.load(p)
    assert back.mu.dtype == np.float64 and back.sigma.dtype == np.float64 and back.sigma.shape == (5, 5)
    np.testing.assert_array_equal(back.mu, st.mu)
    np.testing.assert_array_equal(back.sigma, st.sigma)
    np.testing.assert_array_equal(back.features, feats.numpy())
    assert back.n == 50 and back.provenance == {"dataset": "x", "note": "ü"} and back.sha256 == h
    with np.load(p, allow_pickle=False) as z:  # a plain npz: no pickles
        assert z["mu"].dtype == np.float64
    # the hash is of the numbers: the same features give the same hash, other provenance too; a change of n does not
    assert stats_of(feats, provenance={"other": 1}, keep_features=True).sha256 == h
    assert stats_of(feats).sha256 != h  # features not kept
    assert stats_of(feats[:49]).sha256 != stats_of(feats).sha256
    with pytest.raises(EvalConfigError, match="not found"):
        FeatureStats.load(tmp_path / "missing.npz")


def test_reference_stats_cache_hit_miss_and_provenance(tmp_path):
    g = torch.Generator().manual_seed(13)
    images = torch.rand(40, 3, 4, 4, generator=g)
    ext = ModuleExtractor(torch.nn.Flatten(), "flatten-48", resize_mode="none")
    calls = []

    def load_images():
        calls.append(1)
        return [(images[:25], None), (images[25:], None)]  # (images, labels) batches

    st = reference_stats(ext, load_images, tmp_path, "toy set", 4, batch_size=16)
    assert (st.cache_hit, len(calls), st.n) == (False, 1, 40)
    path = reference_stats_path(tmp_path, ext, "toy set", 4)
    assert st.cache_file == str(path) and path.name.startswith("toy-set-4px-fd-")
    prov = FeatureStats.load(path).provenance
    for k, v in {"dataset": "toy set", "resolution": "4", "extractor": "flatten-48", "n": 40, "dim": 48,
                 "weights_sha256": ext.weights_sha256, "resize_mode": "none", "format": STATS_FORMAT}.items():
        assert prov[k] == v
    assert {"created_utc", "torch_version", "difrl_version"} <= set(prov)
    np.testing.assert_allclose(st.sigma, stats_of(images.flatten(1)).sigma, atol=1e-14)  # float64, streamed vs two-pass

    hit = reference_stats(ext, load_images, tmp_path, "toy set", 4)
    assert (hit.cache_hit, len(calls), hit.sha256) == (True, 1, st.sha256)
    # another resolution, dataset or extractor (weights) is another file
    reference_stats(ext, load_images, tmp_path, "toy set", (4, 8))
    other = ModuleExtractor(torch.nn.Flatten(), "flatten-48", weights_sha256="0" * 64)
    assert reference_stats_path(tmp_path, other, "toy set", 4) != path
    assert len(calls) == 2
    # asking for the features re-extracts once and caches them
    kept = reference_stats(ext, images, tmp_path, "toy set", 4, keep_features=True)
    assert kept.features is not None and not kept.cache_hit
    assert reference_stats(ext, images, tmp_path, "toy set", 4, keep_features=True).cache_hit
    # a file whose provenance disagrees with its key is refused
    bad = FeatureStats.load(path)
    bad.provenance["dataset"] = "something else"
    bad.save(path)
    with pytest.raises(ValueError, match="were made for"):
        reference_stats(ext, images, tmp_path, "toy set", 4)
    assert not reference_stats(ext, images, tmp_path, "toy set", 4, recompute=True).cache_hit


# --- extractors -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def inception_weights(tmp_path_factory):
    return save_random_inception_weights(tmp_path_factory.mktemp("inception") / "weights-random-inception.pth")


def _tf1_bilinear(x: torch.Tensor, size: int) -> torch.Tensor:
    """TF1 `resize_bilinear(align_corners=False)` (the original FID code's resize), written out: output index i
    reads input position i * in / out (no half-pixel offset), interpolating between floor and floor + 1 (clamped).
    x: [B, C, H, W] float -> [B, C, size, size]."""
    def along(t, dim):
        n = t.shape[dim]
        pos = torch.arange(size, dtype=torch.float64) * (n / size)
        i0 = pos.floor().long().clamp(max=n - 1)
        i1 = (i0 + 1).clamp(max=n - 1)
        w = (pos - i0).to(t.dtype)
        shape = [1] * t.dim()
        shape[dim] = size
        a, b = t.index_select(dim, i0), t.index_select(dim, i1)
        return a + (b - a) * w.view(shape)

    return along(along(x.float(), 2), 3)


def test_inception_extractor_offline(inception_weights, monkeypatch):
    import torch_fidelity.feature_extractor_inceptionv3 as tfi
    from torchmetrics.image.fid import NoTrainInceptionV3

    def no_download(*a, **k):
        raise AssertionError("tried to download")

    monkeypatch.setattr(tfi, "load_state_dict_from_url", no_download)
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", no_download)
    ext = InceptionExtractor(inception_weights)
    assert ext.num_features == 2048 and ext.metric == "fid" and "tf1-bilinear" in ext.name
    assert ext.weights_sha256 == sha256_file(inception_weights)
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        feats = ext(images)
        assert feats.shape == (2, 2048) and feats.dtype == torch.float32 and torch.isfinite(feats).all()
        assert feats.std() > 1e-3  # He-initialised random weights: activations keep their scale
        # what decides FID's feature space, checked without torch-fidelity / torchmetrics code (torchmetrics'
        # NoTrainInceptionV3 subclasses torch-fidelity's extractor, so comparing the two could not fail): the
        # network's first convolution sees the TF1 bilinear resize (align_corners=False, no half-pixel offset)
        # of the rounded uint8 pixels, scaled (x - 128) / 128, and every weight is the file's
        seen = {}
        hook = ext.net.Conv2d_1a_3x3.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0].clone()))
        assert torch.equal(ext(images), feats)
        hook.remove()
        u8 = (images.clamp(0, 1) * 255).round()
        # the network's fp32 resize against this float reimplementation of TF1's: a few ulp of values in [-1, 1]
        torch.testing.assert_close(seen["x"], (_tf1_bilinear(u8, 299) - 128) / 128, rtol=0, atol=1e-5)
        net = ext.net.state_dict()
        file = torch.load(inception_weights, weights_only=True)
        assert set(file) <= set(net) and all(torch.equal(net[k], v) for k, v in file.items())
        assert any(k.endswith("conv.weight") for k in file) and len(file) > 300
        # torchmetrics with antialias=False is that same network (a sanity check of the naming below, not a proof)
        tm = NoTrainInceptionV3("inception-v3-compat", ["2048"], str(inception_weights), antialias=False)
        torch.testing.assert_close(feats, tm(to_uint8(images)), rtol=1e-5, atol=1e-6)  # FP32_REORDER: another wrapper
        # torchmetrics' default resize (torch bilinear with antialias) is another feature space, named apart
        aa = InceptionExtractor(inception_weights, antialias=True)
        assert aa.name != ext.name and "antialias" in aa.resize_mode and aa.weights_sha256 == ext.weights_sha256
        assert not torch.allclose(aa(images[:1]), feats[:1], atol=1e-4)
        seen.clear()  # and the input check above tells the two resizes apart (torch's has half-pixel centres)
        hook = aa.net.Conv2d_1a_3x3.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0].clone()))
        aa(images)
        hook.remove()
        assert (seen["x"] - (_tf1_bilinear(u8, 299) - 128) / 128).abs().max() > 1e-2


def test_inception_extractor_errors(tmp_path):
    with pytest.raises(EvalConfigError, match="not found at .*nowhere.pth"):
        InceptionExtractor(tmp_path / "nowhere.pth")
    with pytest.raises(EvalConfigError, match="needs the Inception weights"):
        InceptionExtractor(None)
    bad = tmp_path / "bad.pth"
    torch.save({"w": torch.zeros(1)}, bad)
    with pytest.raises(EvalConfigError, match="not torch-fidelity's Inception"):
        InceptionExtractor(bad)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    from difrl.rewards.tiny import tiny_reward_options

    return tiny_reward_options(tmp_path_factory.mktemp("tiny_rewards"))["clip_score"]


def test_clip_extractor_matches_the_clip_reward(tiny_clip):
    from difrl.rewards.clip import ClipScore

    ext = ClipExtractor(tiny_clip["model_dir"], processor_dir=tiny_clip["processor_dir"])
    g = torch.Generator().manual_seed(15)
    images = torch.randint(0, 256, (3, 3, 40, 48), generator=g).float() / 255  # on the uint8 grid
    with torch.no_grad():
        feats = ext(images)
        assert feats.shape == (3, 16) and ext.num_features == 16 and ext.metric == "fd_clip"
        # the same embedding as the CLIP reward (which L2-normalises it)
        ref = ClipScore(model_dir=tiny_clip["model_dir"], processor_dir=tiny_clip["processor_dir"]).encode_image(images)
        torch.testing.assert_close(torch.nn.functional.normalize(feats, dim=-1), ref, rtol=1e-5, atol=1e-6)  # fp32
        # without a processor: CLIP's recipe at the model's image size (the tiny processor's settings too)
        bare = ClipExtractor(tiny_clip["model_dir"])
        torch.testing.assert_close(bare(images), feats, **FP32_REORDER)  # the same recipe written apart
    assert bare.weights_sha256 != ext.weights_sha256  # the processor config is part of the identity
    with pytest.raises(EvalConfigError, match="directory not found at .*no-clip"):
        ClipExtractor("/definitely/no-clip")


def test_clip_reward_and_extractor_report_one_weights_hash(tiny_clip, tmp_path):
    """One definition of a weights directory's hash (difrl.utils.io.weights_sha256): the CLIP reward's
    `info()["weights_sha256"]` and the FD_CLIP extractor's `weights_sha256` agree on the same files, and both move
    when one byte of the weights does."""
    import shutil

    from difrl.rewards import build_reward

    mdir, pdir = tmp_path / "model", tmp_path / "processor"
    shutil.copytree(tiny_clip["model_dir"], mdir)
    shutil.copytree(tiny_clip["processor_dir"], pdir)

    def both():
        reward = build_reward("clip_score", model_dir=str(mdir), processor_dir=str(pdir)).info()["weights_sha256"]
        return reward, ClipExtractor(mdir, processor_dir=pdir).weights_sha256

    before = both()
    assert before[0] == before[1] and len(before[0]) == 64
    weights = mdir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor's data (the header stays valid)
    weights.write_bytes(bytes(data))
    after = both()
    assert after[0] == after[1] and after[0] != before[0]


def test_clip_extractor_loads_strictly_like_the_rewards(tiny_clip, tmp_path):
    """rewards.vision.load_clip_model for both: a weights file missing a parameter is an EvalConfigError naming
    the option, not a randomly initialised projection (transformers' from_pretrained would only warn)."""
    import shutil

    from safetensors.torch import load_file, save_file

    mdir = tmp_path / "model"
    shutil.copytree(tiny_clip["model_dir"], mdir)
    sd = load_file(str(mdir / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if k != "visual_projection.weight"}, str(mdir / "model.safetensors"))
    with pytest.raises(EvalConfigError, match=r"ClipExtractor: the weights in .* \(eval.fid.weights\) do not fit.*"
                                              r"1 missing keys \['visual_projection.weight'\]"):
        ClipExtractor(mdir, option="eval.fid.weights")


@pytest.fixture(scope="module")
def tiny_dinov2(tmp_path_factory):
    from transformers import Dinov2Config, Dinov2Model

    cfg = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2, image_size=56,
                       patch_size=14)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(16)
        model = Dinov2Model(cfg)
        with torch.no_grad():
            model.embeddings.position_embeddings.normal_(0, 1.0)  # make interpolation visible
    d = tmp_path_factory.mktemp("tiny_dinov2") / "dinov2-tiny"
    model.save_pretrained(str(d))
    return d


def test_dinov2_extractor(tiny_dinov2, tiny_clip):
    from transformers import Dinov2Model

    images = torch.rand(2, 3, 40, 40, generator=torch.Generator().manual_seed(17))
    model = Dinov2Model.from_pretrained(str(tiny_dinov2), local_files_only=True).eval()
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        # at the model's native grid (56 / 14 = 4) no position interpolation: the plain model on EDM2's preprocessing
        ext = DinoV2Extractor(tiny_dinov2, image_size=56)
        x = torch.nn.functional.interpolate(to_uint8(images).float(), size=(56, 56), mode="bicubic", antialias=True)
        want = model(pixel_values=(x / 255 - mean) / std).pooler_output
        feats = ext(images)
        assert feats.shape == (2, 32) and ext.metric == "fd_dinov2" and ext.num_features == 32
        torch.testing.assert_close(feats, want, **FP32_REORDER)  # the plain model called apart: fp32 reordering
        # at 112 (an 8 x 8 grid) the hub-style position interpolation differs a little from transformers' own
        hub = DinoV2Extractor(tiny_dinov2, image_size=112)(images)
        hf = DinoV2Extractor(tiny_dinov2, image_size=112, pos_interp="transformers")(images)
        rel = float((hub - hf).norm() / hf.norm())
        assert 0 < rel < 0.01, rel  # 1.4e-4 here
        tf1 = DinoV2Extractor(tiny_dinov2, image_size=56, resize="tf1-bilinear")
        assert tf1(images).shape == (2, 32) and tf1.name != ext.name
    with pytest.raises(EvalConfigError, match="not 'dinov2'"):
        DinoV2Extractor(tiny_clip["model_dir"])
    with pytest.raises(EvalConfigError, match="directory not found"):
        DinoV2Extractor("/definitely/no-dinov2")
