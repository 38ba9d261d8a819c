"""Sessions: the state that outlives a network connection, its registry, wills and replays."""
