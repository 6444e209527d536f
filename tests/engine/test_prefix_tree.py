from hypothesis import given, settings, strategies as st

from batchgen.pipeline.engine.prefix_tree import PrefixTree


def distinct_prefixes(seqs):
    return len({tuple(s[:i]) for s in seqs for i in range(1, len(s) + 1)})


def test_shared_prefix_becomes_one_node_split_at_divergence():
    t = PrefixTree()
    t.insert("a", [1, 2, 3, 4])
    t.insert("b", [1, 2, 5])
    shared = t.root.children[1]
    assert shared.tokens == [1, 2] and shared.depth == 2 and shared.size == 2
    assert sorted(c.tokens for c in shared.children.values()) == [[3, 4], [5]]
    assert t.node_of("a").depth == 4 and t.node_of("b").depth == 3
    assert t.token_count() == 5


def test_nested_three_levels_and_sequence_ending_inside_an_edge():
    t = PrefixTree()
    system, shot, doc = [1] * 5, [2] * 3, [3] * 2
    t.insert("q1", system + shot + doc + [7])
    t.insert("q2", system + shot + doc + [8])
    t.insert("q3", system + shot + [9])
    t.insert("q4", system + [4])
    t.insert("sys", system)  # ends exactly at a branching point
    depths = sorted(n.depth for n in t.nodes() if n.size >= 2 and n is not t.root)
    assert depths == [5, 8, 10]
    assert t.node_of("sys").depth == 5 and t.node_of("sys").keys == ["sys"]
    assert t.token_count() == distinct_prefixes([system + shot + doc + [7], system + shot + doc + [8],
                                                 system + shot + [9], system + [4], system])


def test_duplicates_and_empty_sequences_share_their_node():
    t = PrefixTree()
    t.insert(0, [5, 6])
    t.insert(1, [5, 6])
    t.insert(2, [])
    assert t.node_of(0) is t.node_of(1) and t.node_of(0).size == 2
    assert t.node_of(2) is t.root and len(t) == 3


def test_inserting_a_key_twice_is_refused():
    t = PrefixTree()
    t.insert("x", [1])
    try:
        t.insert("x", [2])
    except KeyError:
        return
    raise AssertionError("duplicate key accepted")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=8), min_size=1, max_size=12))
def test_token_count_is_the_number_of_distinct_prefixes(seqs):
    t = PrefixTree()
    for i, s in enumerate(seqs):
        t.insert(i, s)
    assert t.token_count() == distinct_prefixes(seqs)
    assert len(t) == len(seqs)
    for node in t.nodes():
        assert node.size == len(node.keys) + sum(c.size for c in node.children.values())
        if node is not t.root:
            assert node.tokens and node.depth == node.parent.depth + len(node.tokens)
    for i, s in enumerate(seqs):
        node, path = t.node_of(i), []
        while node is not t.root:
            path[:0] = node.tokens
            node = node.parent
        assert path == s
