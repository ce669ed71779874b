"""The loaders and pipelines `omnifeed bench` knows, by name: read when flags parse, without importing any loader."""

LOADERS = (
    "omnifeed",
    "omnifeed-draft",
    "omnifeed-processes",
    "omnifeed-service",
    "dataloader",
    "webloader",
    "statefuldataloader",
    "streaming",
    "litdata",
    "dali",
)
