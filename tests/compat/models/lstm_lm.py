"""A small LSTM language model in the style of PyTorch's word-language-model example: an
Embedding, a 2-layer nn.LSTM (batch_first, dropout between the layers), a Linear decoder,
uniform init in init_weights, and (h0, c0) passed into the LSTM: zeros made by
weight.new_zeros, a learned initial state expanded over the batch (learn_init), or a state
the caller passes in, shaped (num_layers, batch, hidden) as torch's (StatefulRNNModel).
forward returns (logits, loss)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class RNNModel(nn.Module):
    def __init__(self, ntoken=48, ninp=16, nhid=24, nlayers=2, dropout=0.0, learn_init=False):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(nhid, ntoken)
        self.learn_init = learn_init
        if learn_init:
            # one learned (h0, c0) for every sequence
            self.h_init = nn.Parameter(torch.empty(nlayers, 1, nhid).uniform_(-0.5, 0.5))
            self.c_init = nn.Parameter(torch.empty(nlayers, 1, nhid).uniform_(-0.5, 0.5))
        self.nhid = nhid
        self.nlayers = nlayers
        self.init_weights()

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def init_hidden(self, bsz):
        if self.learn_init:
            return (self.h_init.expand(-1, bsz, -1).contiguous(),
                    self.c_init.expand(-1, bsz, -1).contiguous())
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                weight.new_zeros(self.nlayers, bsz, self.nhid))

    def forward(self, input, targets=None, hidden=None):
        if hidden is None:
            hidden = self.init_hidden(input.size(0))
        emb = self.drop(self.encoder(input))
        output, (h_n, c_n) = self.rnn(emb, hidden)
        output = self.drop(output)
        logits = self.decoder(output)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, self.ntoken), targets.reshape(-1))
        return logits, loss


class StatefulRNNModel(RNNModel):
    """The caller passes the state, as a truncated-BPTT loop carries it between batches."""

    def forward(self, input, h0, c0, targets=None):
        return super().forward(input, targets, (h0, c0))
