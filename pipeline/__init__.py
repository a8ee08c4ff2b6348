"""What drives Moses and the rescoring experiments end to end, on the Moses side's parts
(``nlmserve.moses_plugin``: n-best lists, rescoring, MERT, BLEU, the moses.ini line):

    experiment        ``nlmserve experiment``: train, rescore, tune, rerank, BLEU (``make demo``)
    config            ``ExperimentConfig``, its inputs and settings
    steps             its steps once NLM0's source is known (``Pipeline``, ``NlmSource``)
    workdir           what its work directory was made from (``inputs.json``)
    report            its table: text, Markdown, JSON, a chart
    moses_experiment  ``nlmserve moses-experiment``: the NLM inside Moses, tuned by mert-moses.pl;
                      its steps are the research harness's too (experiments/moses_mert.py)

Import path: ``nlmserve.pipeline`` (folder ``pipeline/``).
"""
