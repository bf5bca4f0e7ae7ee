import subprocess
import sys

import pytest

from engine.block_hash import block_hashes, content_hash, hash_block, root_hash

# Fixed vectors: if any of these change, every router and engine in a fleet
# disagrees about block identity, so a change must be deliberate.
VECTORS = {
    "root_empty": 155199165919467756,
    "root_smollm2": 13741215319213698189,
    "range40": [5615370441591158241, 276808301682603775],
    "range32_salt_m": [16727938818361710730, 7471150049133371614],
    "range32_image_at_20": [5615370441591158241, 15641841309037749884],
    "single": 1369677447038887551,
}


def test_fixed_vectors():
    assert root_hash(b"") == VECTORS["root_empty"]
    assert root_hash("SmolLM2") == VECTORS["root_smollm2"]
    assert block_hashes(list(range(40)), 16) == VECTORS["range40"]
    assert block_hashes(list(range(32)), 16, salt="m") == VECTORS["range32_salt_m"]
    assert block_hashes(list(range(32)), 16, mm_inputs=[(20, content_hash(b"img"))]) == VECTORS["range32_image_at_20"]
    assert hash_block(0, [1, 2, 3], [b"x"]) == VECTORS["single"]


def test_same_in_a_fresh_process():
    code = "from engine.block_hash import block_hashes; print(block_hashes(list(range(40)), 16))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=".").stdout
    assert out.strip() == str(VECTORS["range40"])


def test_chaining_gives_prefix_semantics():
    a = block_hashes(list(range(48)), 16)
    b = block_hashes(list(range(32)) + [999] * 16, 16)
    assert a[:2] == b[:2] and a[2] != b[2]
    # Same third block content after a different prefix: different identity.
    c = block_hashes([7] * 16 + list(range(16, 48)), 16)
    assert c[1] != a[1] and c[2] != a[2]


def test_partial_block_has_no_hash_and_block_size_matters():
    assert len(block_hashes(list(range(31)), 16)) == 1
    assert block_hashes(list(range(32)), 8)[1] != block_hashes(list(range(32)), 16)[0]
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)


def test_extra_keys_are_length_prefixed():
    assert hash_block(1, [5], [b"ab", b"c"]) != hash_block(1, [5], [b"a", b"bc"])
    assert hash_block(1, [5], [content_hash(b"img-1")]) != hash_block(1, [5], [content_hash(b"img-2")])
