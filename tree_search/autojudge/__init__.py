"""AutoJudge: mine important/unimportant mismatches, train the logistic judge head, and load it for verification."""
