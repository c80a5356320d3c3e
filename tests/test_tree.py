"""Tree topology: level sizes, parent pointers and everything derived from them; validation errors."""
import pytest
import torch

from mamba_draft.tree import MAX_TREE_NODES, Tree, TreeConfig


@pytest.mark.parametrize(
    "branching, sizes",
    [((3, 2, 2, 1, 1), (3, 6, 12, 12, 12)), ((3, 3, 2, 1), (3, 9, 18, 18)), ((2, 2, 2, 1, 1, 1), (2, 4, 8, 8, 8, 8)),
     ((1, 1, 1, 1, 1), (1, 1, 1, 1, 1)), ((4,), (4,))],
)
def test_level_sizes_and_node_count(branching, sizes):
    config = TreeConfig(branching)
    assert config.level_sizes == sizes
    assert config.num_nodes == sum(sizes)
    assert config.depth == len(branching)
    tree = config.build()
    assert len(tree) == sum(sizes) + 1
    assert [stop - start for start, stop in tree.levels] == [1, *sizes]
    # every node at depth d has branching[d] children; the last level has none
    for node, kids in enumerate(tree.children):
        d = tree.depths[node]
        assert len(kids) == (branching[d] if d < len(branching) else 0)


def test_parent_array_mask_and_paths_of_a_small_tree():
    tree = TreeConfig((2, 2)).build()
    assert tree.parents == (-1, 0, 0, 1, 1, 2, 2)
    assert tree.depths == (0, 1, 1, 2, 2, 2, 2)
    assert tree.children[1] == (3, 4) and tree.children[2] == (5, 6)
    assert tree.leaf_paths == ((1, 3), (1, 4), (2, 5), (2, 6))
    assert tree.path_to(6) == [2, 6]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask, expected)
    assert tree.ancestor_mask.sum(1).sub(1).tolist() == list(tree.depths)  # depth = ancestors


def test_chain_is_a_path():
    tree = TreeConfig((1, 1, 1)).build()
    assert tree.parents == (-1, 0, 1, 2)
    assert tree.leaf_paths == ((1, 2, 3),)
    assert torch.equal(tree.ancestor_mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_parse_forms():
    assert TreeConfig.parse("3,2,2,1,1") == TreeConfig((3, 2, 2, 1, 1))
    assert TreeConfig.parse("3, 2") == TreeConfig((3, 2))  # "(3, 2)" is refused: tests/test_inputs_strict.py
    assert TreeConfig.parse([4]) == TreeConfig((4,))
    assert str(TreeConfig((3, 2))) == "(3,2)"


@pytest.mark.parametrize(
    "bad, message",
    [((3, 0), "positive"), ((2, -1), "positive"), ((2.5,), "positive"), ((True,), "positive"),
     ((64, 64), "budget")],
)
def test_invalid_configs_raise_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        TreeConfig(bad)


def test_parse_rejects_garbage():
    with pytest.raises(ValueError, match="cannot parse"):
        TreeConfig.parse("3,x,2")
    with pytest.raises(ValueError, match="empty"):
        TreeConfig.parse("")


def test_node_budget_boundary():
    TreeConfig((MAX_TREE_NODES,))
    with pytest.raises(ValueError, match="budget"):
        TreeConfig((MAX_TREE_NODES + 1,))


def test_tree_rejects_bad_parent_arrays():
    with pytest.raises(ValueError, match="root"):
        Tree((0, 0))
    with pytest.raises(ValueError, match="precede"):
        Tree((-1, 2, 0))
    with pytest.raises(ValueError, match="level order"):
        Tree((-1, 0, 1, 0))
